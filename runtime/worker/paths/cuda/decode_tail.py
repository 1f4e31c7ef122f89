"""The K/V of the last few decode steps, kept out of the KV pool until the batch changes.

MLX updates an array in place only when nothing else holds it; a step still on the device
holds the pools it reads. If every decode step wrote its new K/V into the pool, step N+1
could only be submitted after step N was read back (else MLX copies the whole pool on each
write), and the device would wait for the host to encode every step. With the tail, a decode
step writes nothing in place: its new K/V are appended to these small per-batch arrays
(a new array per step, written by the paged kernel itself), which it reads after the pool
positions. The tail is flushed into the pool (and the device slot table) by the first step
that changes the batch — new rows, a prefill — or after ``max_steps`` steps; only such a
step waits for the read-back. A batch that only lost rows keeps the tail (``narrow``): the
rows that left move to ``left`` and reach the pool with the next flush, which comes before
anything reads their slots (a prefill flushes first; a failed step's reset flushes too).

Each layer's tail has room for ``capacity_for(rows)`` positions (a fixed shape per row count)
and holds ``len(steps)`` of them: the paged kernels take the length as an array, so a compiled
decode step does not depend on it (one trace per row class and launch shape, not one per
length). A flush makes the device wait for the host (a one-row 8B step at 32k took 9.7 ms
with a flush against 6.8 without; a 1B one-row step 3.0 against 2.0 ms), so small batches,
whose tails cost little, hold more steps between flushes; a big batch's tail is copied by
every step, so it stays at ``max_steps``.

Invariant: for every row of the batch, its last ``len(steps)`` positions are the first
``len(steps)`` of the tail (in step order) and not yet in the pool or the slot table; all
earlier positions are, but for those of rows that left, which ``left`` holds.
"""

from __future__ import annotations

from collections import Counter

import mlx.core as mx
import numpy as np

from runtime.protocol.worker import DecodeBatch
from runtime.worker.paths.deferred_steps import DeferredSteps
from runtime.worker.pools.kv_pool import KVPool

# Rows x positions a tail holds at most, past ``max_steps`` positions a row: small batches get
# up to ``FEW_ROWS_FACTOR`` times ``max_steps`` (8 rows x 64 positions of an 8B model's K/V is
# 2 MiB a layer, each step copies what it holds).
TAIL_POSITIONS = 512
FEW_ROWS_FACTOR = 4


def tail_capacity(max_steps: int, rows: int = 1) -> int:
    """Positions a tail of ``rows`` rows holds at most (the most at one row)."""
    return max(max_steps, min(FEW_ROWS_FACTOR * max_steps, TAIL_POSITIONS // max(rows, 1)))


class DecodeTail:
    """Per-layer (B, n_kv_heads, capacity_for(B), head_dim) K/V of the current decode batch."""

    def __init__(self, num_layers: int, max_steps: int) -> None:
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.max_steps = max_steps
        self.steps = DeferredSteps(max_steps, self.capacity_for)
        self._empty: dict[tuple, mx.array] = {}  # an unused tail per shape, for a batch's first step
        # Rows that left the batch with positions still here (``narrow``): (rows, positions,
        # slots, every layer's keys, values), step-major; written into the pool first by ``flush``.
        self.left: list[tuple[mx.array, mx.array, mx.array, list[mx.array], list[mx.array]]] = []
        self.events: Counter[str] = Counter()  # decode steps by what they did to the tail (the worker trace's)

    def capacity_for(self, rows: int) -> int:
        """Positions a tail of ``rows`` rows (padding included) holds before it is flushed."""
        return tail_capacity(self.max_steps, rows)

    @property
    def capacity(self) -> int:
        """The current batch's capacity (set by the batch's first step, ``steps.add``)."""
        return self.steps.max_steps

    def old_length(self) -> mx.array:
        """How many positions the tail holds before this step (recorded in ``steps`` already),
        as the int32 array the paged kernels read."""
        return mx.array([len(self.steps) - 1], dtype=mx.int32)

    def old(self, rows: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> tuple[list[mx.array], list[mx.array]]:
        """Every layer's tail before this step; a layer without one yet (the batch's first
        step: its length is 0) gets an ``unused`` one. Layer by layer, since a forward built
        layer by layer replaces each layer's tail as it goes."""
        empty_keys, empty_values = self.unused(rows, n_kv_heads, head_dim, dtype)
        return ([k if k is not None else e for k, e in zip(self.keys, empty_keys)],
                [v if v is not None else e for v, e in zip(self.values, empty_values)])

    def unused(self, rows: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype) -> tuple[list[mx.array], list[mx.array]]:
        """A tail of this shape for every layer, never read (zeros, kept per shape: one per row
        class at most); the kernels and the compiled steps take its shape, not its contents."""
        key = (rows, n_kv_heads, head_dim, dtype)
        empty = self._empty.get(key)
        if empty is None:
            empty = self._empty[key] = mx.zeros((rows, n_kv_heads, self.capacity_for(rows), head_dim), dtype=dtype)
        return [empty] * len(self.keys), [empty] * len(self.values)

    def set(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Make (B, n_kv_heads, max_steps, head_dim) K/V, whose first ``len(steps)`` positions
        end with the current step's, the layer's tail (the paged kernel writes them while it
        attends)."""
        assert keys.shape[2] == self.capacity, "a tail of the full capacity"
        self.keys[layer], self.values[layer] = keys, values

    def narrow(self, kept: list[int], rows: np.ndarray, decode: DecodeBatch, pad: int) -> bool:
        """Make the tail the new batch's where that batch only dropped rows (``kept``, from
        ``steps.kept_rows``) and its capacity holds one more step: the rows left are taken out
        (into ``left``, for the next flush) and nothing is written in place, so the step need
        not wait for the one before it. False (nothing changed) where it cannot."""
        held = len(self.steps)
        capacity = self.capacity_for(len(kept))
        if held >= capacity or any(k is None for k in self.keys):
            return False
        index = mx.array([i if i >= 0 else 0 for i in kept], dtype=mx.int32)
        dropped, left = self.steps.narrow(kept, rows, decode, pad)
        if left is not None:
            out = mx.array(dropped, dtype=mx.int32)
            keys, values = [k[out, :, :held] for k in self.keys], [v[out, :, :held] for v in self.values]
            mx.async_eval(keys + values)  # copied out now: held lazily they would keep the old tails alive
            self.left.append((*left, keys, values))
        self.steps.max_steps = capacity
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            self.keys[layer], self.values[layer] = (self._resized(a[index], capacity, held) for a in (k, v))
        return True

    @staticmethod
    def _resized(tail: mx.array, capacity: int, held: int) -> mx.array:
        if tail.shape[2] == capacity:
            return tail
        kept = tail[:, :, :held]
        return mx.concatenate([kept, mx.zeros((*kept.shape[:2], capacity - held, kept.shape[3]), dtype=kept.dtype)],
                              axis=2)

    def flush(self, pool: KVPool, device_table: mx.array) -> bool:
        """Write the rows that left (``narrow``), then the tail, into the pool and the slot
        table; False when there was nothing to write."""
        wrote = bool(self.left)
        for rows, positions, slots, keys, values in self.left:
            _write(pool, device_table, rows, positions, slots, keys, values)
        self.left = []
        steps = len(self.steps)
        taken = self.steps.take()
        if taken is None:
            return wrote
        _write(pool, device_table, *taken, [k[:, :, :steps] for k in self.keys],  # type: ignore[index]
               [v[:, :, :steps] for v in self.values])  # type: ignore[index]
        self.clear()
        return True

    def abandon(self, pool: KVPool, device_table: mx.array) -> None:
        """After a failed step: write what the tail holds where its arrays evaluate (a request
        that finished before the failure was cached when its last step came back; the failed
        step's rows fail, so what reaches their slots is never read), else drop it."""
        held = [a for a in self.keys + self.values if a is not None]
        held += [a for entry in self.left for a in entry[3] + entry[4]]
        try:
            mx.eval(held)
        except Exception:  # (the failure's own arrays): their requests were not cached
            self.clear()
            return
        if len(self.steps) and any(k is None for k in self.keys):
            self.steps.clear()  # a new batch's first step failed before any layer: nothing of it to write
        self.flush(pool, device_table)

    def clear(self) -> None:
        """Forget the tail (after a flush)."""
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.steps.clear()
        self.left = []


def _write(pool: KVPool, device_table: mx.array, rows: mx.array, positions: mx.array, slots: mx.array,
           keys: list[mx.array], values: list[mx.array]) -> None:
    """Write (B, n_kv_heads, steps, head_dim) K/V per layer at their step-major slots, and the table."""
    for layer, (k, v) in enumerate(zip(keys, values)):
        b, h, steps, d = k.shape
        pool.write(layer, slots, k.transpose(2, 0, 1, 3).reshape(steps * b, h, d),
                   v.transpose(2, 0, 1, 3).reshape(steps * b, h, d))
    device_table[rows, positions] = slots
