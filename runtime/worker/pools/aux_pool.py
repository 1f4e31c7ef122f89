"""Auxiliary-state pool: recurrent/conv state of hybrid layers, addressed by slot id."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from runtime.worker.model.discovery import CacheLayout


class AuxPool:
    """``states[k][j]``: (num_slots, *shape) array for state j of the k-th auxiliary cache entry.

    A slot holds one request's state (live) or a snapshot. Writing a slot copies
    values in, so a snapshot never changes when the live state moves on.

    ``row_writes``: write a batch's states slot by slot (one slice update each) instead of as
    one scatter. MLX's CPU scatter moves about 1 GB/s where a slice update copies at memory
    speed: at 16 rows of a tiny Qwen3-Next on 2 CPUs the scatter took 6.5 of a 25 ms decode
    step, the slice updates about 1.5 (``scripts/profile_decode.py``, docs/BENCHMARKS.md).
    A GPU keeps the one scatter kernel.
    """

    def __init__(self, states: list[list[mx.array]], row_writes: bool = False) -> None:
        """A pool over existing state arrays (``allocate`` makes new ones; a compiled decode
        step wraps its traced inputs)."""
        self.states = states
        self.num_slots = states[0][0].shape[0]
        self.row_writes = row_writes

    @classmethod
    def allocate(cls, templates: list[list[tuple[tuple[int, ...], mx.Dtype]]], num_slots: int,
                 row_writes: bool = False) -> AuxPool:
        states = [[mx.zeros((num_slots, *shape), dtype=dtype) for shape, dtype in entry] for entry in templates]
        mx.eval(states)
        return cls(states, row_writes)

    @staticmethod
    def probe(model: nn.Module, layout: CacheLayout) -> list[list[tuple[tuple[int, ...], mx.Dtype]]]:
        """Run one token through a fresh mlx-lm cache to learn each auxiliary state's shape."""
        caches = model.make_cache()
        model(mx.array([[1]], dtype=mx.int32), cache=caches)
        caches = layout.flatten(caches)  # a CacheList's parts are entries of their own
        templates = []
        for entry in layout.aux_layers:
            states = caches[entry].cache
            if any(s is None for s in states):
                raise ValueError(f"cache entry {entry}: a state stayed empty after a forward pass")
            templates.append([(tuple(s.shape[1:]), s.dtype) for s in states])
        mx.eval([s for t in caches for s in getattr(t, "cache", []) if s is not None])
        return templates

    @staticmethod
    def bytes_per_slot(templates: list[list[tuple[tuple[int, ...], mx.Dtype]]]) -> int:
        total = 0
        for entry in templates:
            for shape, dtype in entry:
                n = dtype.size
                for d in shape:
                    n *= d
                total += n
        return total

    @property
    def nbytes(self) -> int:
        return sum(a.nbytes for entry in self.states for a in entry)

    def read(self, k: int, slots: mx.array) -> list[mx.array]:
        """States of auxiliary entry k at ``slots`` (B,), batch-major."""
        return [a[slots] for a in self.states[k]]

    def write(self, k: int, slots: mx.array, values: list[mx.array]) -> None:
        """Write ``values[j]`` (B, ...) into state j of auxiliary entry k at ``slots`` (B,)."""
        for j, value in enumerate(values):
            value = value.astype(self.states[k][j].dtype)
            if self.row_writes:
                state = self.states[k][j]
                for b in range(value.shape[0]):  # (``slots`` may be traced: a dynamic start)
                    state = mx.slice_update(state, value[b : b + 1], slots[b : b + 1], axes=(0,))
                self.states[k][j] = state
            else:
                self.states[k][j][slots] = value

    def caches(self, slots: mx.array | None) -> list[ArraysCache]:
        """One mlx-lm ``ArraysCache`` per auxiliary entry, holding the states at ``slots`` (B,),
        or empty (None: rows that start from no state)."""
        caches = []
        for k in range(len(self.states)):
            cache = ArraysCache(len(self.states[k]))
            if slots is not None:
                cache.cache = self.read(k, slots)
            caches.append(cache)
        return caches

    def store(self, caches: list[ArraysCache], slots: mx.array) -> None:
        """Write each cache's states back at ``slots``."""
        for k, cache in enumerate(caches):
            self.write(k, slots, cache.cache)

    def copy(self, src: int, dst: int) -> None:
        """Snapshot/restore/fork: copy slot ``src`` into slot ``dst`` for every entry."""
        for entry in self.states:
            for a in entry:
                a[dst : dst + 1] = a[src : src + 1]

    def zero(self, slot: int) -> None:
        """Clear a slot: the state of a request that has seen no tokens."""
        for entry in self.states:
            for a in entry:
                a[slot : slot + 1] = mx.zeros((1, *a.shape[1:]), dtype=a.dtype)

    def arrays(self) -> list[mx.array]:
        return [a for entry in self.states for a in entry]
