"""Auxiliary-state pool: recurrent/conv state of hybrid layers, addressed by slot id."""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import ArraysCache

from runtime.worker.model.discovery import CacheLayout

# A decode batch that only lost rows keeps the rest resident (``AuxPool._narrowed``) rather than write
# the batch back and read it again, a write in place that waits for the step before.
NARROW_BATCH = True


class AuxPool:
    """``states[k][j]``: (num_slots, *shape) array for state j of the k-th auxiliary cache entry.

    A slot holds one request's state (live) or a snapshot. Writing a slot copies
    values in, so a snapshot never changes when the live state moves on.

    ``row_writes``: write a batch's states slot by slot (one slice update each) instead of as
    one scatter. MLX's CPU scatter moves about 1 GB/s where a slice update copies at memory
    speed: at 16 rows of a tiny Qwen3-Next on 2 CPUs the scatter took 6.5 of a 25 ms decode
    step, the slice updates about 1.5 (``scripts/profile_decode.py``, docs/BENCHMARKS.md).
    A GPU keeps the one scatter kernel.

    Resident batch (``batch_states``/``keep``): a decode step's new states stay batch-ordered,
    outside the pool, while the next step decodes the same slots in the same order; they go
    into the pool (one scatter) when another batch comes, or before any other access touches
    one of their slots. A steady batch then neither gathers nor scatters its states: on an H100
    MLX's CUDA gather and scatter of Qwen3-Next's 2 MB-per-row states took 4.6 of a 16-row
    step's 15 ms of kernels (docs/BENCHMARKS.md, session 35).
    A batch that only lost rows of the resident one keeps the rest resident (``NARROW_BATCH``):
    the rows that left are copied out (``left``) and written with the next flush, so that step
    writes nothing in place either.
    Invariant: a slot in ``resident_slots`` or ``left`` holds a stale value in the pool; every
    method but ``batch_states``/``keep``/``arrays`` flushes before touching such a slot.
    """

    def __init__(self, states: list[list[mx.array]], row_writes: bool = False, narrows: bool = True) -> None:
        """A pool over existing state arrays (``allocate`` makes new ones); ``narrows``: a batch that
        only lost rows keeps the rest resident (``_narrowed``, where ``NARROW_BATCH`` allows it)."""
        self.states = states
        self.num_slots = states[0][0].shape[0]
        self.row_writes = row_writes
        self.narrows = narrows
        self.resident_slots: tuple[int, ...] | None = None
        self.resident: list[list[mx.array]] = []  # per entry, per state: (B, ...) in batch order
        self.left: list[tuple[list[int], list[list[mx.array]]]] = []  # rows that left it: (slots, states)
        self.events: Counter[str] = Counter()  # decode batches by how they got their states (the worker trace's)

    @classmethod
    def allocate(cls, templates: list[list[tuple[tuple[int, ...], mx.Dtype]]], num_slots: int,
                 row_writes: bool = False, narrows: bool = True) -> AuxPool:
        states = [[mx.zeros((num_slots, *shape), dtype=dtype) for shape, dtype in entry] for entry in templates]
        mx.eval(states)
        return cls(states, row_writes, narrows)

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

    def batch_states(self, slots: list[int]) -> tuple[list[list[mx.array]], bool]:
        """A decode batch's states at ``slots`` (per entry, per state, batch-major): the resident
        ones if the last kept batch had these slots (or more: ``_narrowed``), else read from the
        pool (the resident batch written back first); and whether that wrote the pool in place."""
        if self.resident_slots == tuple(slots):
            self.events["resident"] += 1
            return self.resident, False
        if NARROW_BATCH and self.narrows and self._narrowed(slots):
            self.events["narrowed"] += 1
            return self.resident, False
        wrote = self.flush()
        self.events["written back" if wrote else "read"] += 1
        index = mx.array(slots, dtype=mx.int32)
        return [self._read(k, index) for k in range(len(self.states))], wrote

    def _narrowed(self, slots: list[int]) -> bool:
        """Make a batch whose real slots (slot 0 pads) are all resident the resident batch, the rows
        that left copied out into ``left``; False (nothing changed) for any other batch."""
        if self.resident_slots is None:
            return False
        where = {slot: i for i, slot in enumerate(self.resident_slots) if slot}
        if any(slot and slot not in where for slot in slots):
            return False
        staying = set(slots)
        gone = [i for i, slot in enumerate(self.resident_slots) if slot and slot not in staying]
        if gone:
            out = mx.array(gone, dtype=mx.int32)
            states = [[a[out] for a in entry] for entry in self.resident]
            mx.async_eval([a for entry in states for a in entry])  # copied out now: the old batch is freed
            self.left.append(([self.resident_slots[i] for i in gone], states))
        take = mx.array([where.get(slot, 0) for slot in slots], dtype=mx.int32)  # (padding rows: any state)
        self.resident = [[a[take] for a in entry] for entry in self.resident]
        self.resident_slots = tuple(slots)
        return True

    def zero_batch(self, rows: int) -> list[list[mx.array]]:
        """Zero states of ``rows`` rows, batch-major (a warm-up trace's inputs)."""
        return [[mx.zeros((rows, *a.shape[1:]), dtype=a.dtype) for a in entry] for entry in self.states]

    def keep(self, slots: list[int], states: list[list[mx.array]]) -> None:
        """Hold a decode step's new states at ``slots`` as the resident batch (``batch_states``
        after any flush: the pool holds every other slot's latest state)."""
        assert self.resident_slots is None or self.resident_slots == tuple(slots)
        self.resident_slots, self.resident = tuple(slots), states

    def flush(self) -> bool:
        """Write the rows that left, then the resident batch, into the pool; whether there was
        any (a write in place)."""
        wrote = bool(self.left)
        for slots, states in self.left:
            index = mx.array(slots, dtype=mx.int32)
            for k, values in enumerate(states):
                self._write(k, index, values)
        self.left = []
        if self.resident_slots is None:
            return wrote
        index = mx.array(self.resident_slots, dtype=mx.int32)
        for k, values in enumerate(self.resident):
            self._write(k, index, values)
        self.resident_slots, self.resident = None, []
        return True

    def drop(self) -> None:
        """After a failed step: write the resident and left states where they evaluate (a request
        that finished before the failure was cached with its slot; the failed step's rows fail,
        so what reaches their slots is never read), else forget them."""
        try:
            mx.eval(self.arrays()[len(self.pool_arrays()):])
        except Exception:  # (the failure's own arrays): their requests were not cached
            self.resident_slots, self.resident, self.left = None, [], []
            return
        self.flush()

    def _touch(self, slots: mx.array | list[int] | int) -> None:
        """Flush first where an access touches a resident slot (or one that left it)."""
        if self.resident_slots is None and not self.left:
            return
        wanted = {slots} if isinstance(slots, int) else set(slots if isinstance(slots, list) else slots.tolist())
        held = set(self.resident_slots or ()).union(*(set(s) for s, _ in self.left))
        if wanted & held:
            self.flush()

    def read(self, k: int, slots: mx.array) -> list[mx.array]:
        """States of auxiliary entry k at ``slots`` (B,), batch-major."""
        self._touch(slots)
        return self._read(k, slots)

    def _read(self, k: int, slots: mx.array) -> list[mx.array]:
        return [a[slots] for a in self.states[k]]

    def write(self, k: int, slots: mx.array, values: list[mx.array]) -> None:
        """Write ``values[j]`` (B, ...) into state j of auxiliary entry k at ``slots`` (B,)."""
        self._touch(slots)
        self._write(k, slots, values)

    def _write(self, k: int, slots: mx.array, values: list[mx.array]) -> None:
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
        if slots is None:
            return [ArraysCache(len(entry)) for entry in self.states]
        self._touch(slots)  # (once, not per entry)
        return self.wrap([self._read(k, slots) for k in range(len(self.states))])

    @staticmethod
    def wrap(states: list[list[mx.array]]) -> list[ArraysCache]:
        """One mlx-lm ``ArraysCache`` per auxiliary entry over batch-major ``states``."""
        caches = []
        for entry in states:
            cache = ArraysCache(len(entry))
            cache.cache = list(entry)
            caches.append(cache)
        return caches

    def store(self, caches: list[ArraysCache], slots: mx.array) -> None:
        """Write each cache's states back at ``slots``."""
        self._touch(slots)
        for k, cache in enumerate(caches):
            self._write(k, slots, cache.cache)

    def copy(self, src: int, dst: int) -> None:
        """Snapshot/restore/fork: copy slot ``src`` into slot ``dst`` for every entry."""
        self._touch([src, dst])
        for entry in self.states:
            for a in entry:
                a[dst : dst + 1] = a[src : src + 1]

    def zero(self, slot: int) -> None:
        """Clear a slot: the state of a request that has seen no tokens."""
        self._touch(slot)
        for entry in self.states:
            for a in entry:
                a[slot : slot + 1] = mx.zeros((1, *a.shape[1:]), dtype=a.dtype)

    def pool_arrays(self) -> list[mx.array]:
        """The pool's own arrays (every slot's state)."""
        return [a for entry in self.states for a in entry]

    def arrays(self) -> list[mx.array]:
        """The pool's arrays, the resident batch's and those of rows that left it (what a step's
        pool-write marker covers)."""
        return self.pool_arrays() + [a for entry in self.resident for a in entry] + [
            a for _, states in self.left for entry in states for a in entry]
