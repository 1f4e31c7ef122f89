"""The K/V of the last few decode steps, kept out of the KV pool until the batch changes.

MLX updates an array in place only when nothing else holds it; a step still on the device
holds the pools it reads. If every decode step wrote its new K/V into the pool, step N+1
could only be submitted after step N was read back (else MLX copies the whole pool on each
write), and the device would wait for the host to encode every step. With the tail, a decode
step writes nothing in place: its new K/V are appended to these small per-batch arrays
(a new array per step, written by the paged kernel itself), which it reads after the pool
positions. The tail is flushed into the pool (and the device slot table) by the first step
that changes the batch — new rows, a prefill, a row that left — or after ``max_steps``
steps; only such a step waits for the read-back.

Each layer's tail has room for ``capacity_for(rows)`` positions (a fixed shape per row count)
and holds ``len(steps)`` of them: the paged kernels take the length as an array, so a compiled
decode step does not depend on it (one trace per row class and launch shape, not one per
length). A flush makes the device wait for the host (a one-row 8B step at 32k took 9.7 ms
with a flush against 6.8 without; a 1B one-row step 3.0 against 2.0 ms), so small batches,
whose tails cost little, hold more steps between flushes; a big batch's tail is copied by
every step, so it stays at ``max_steps``.

Invariant: for every row of the batch, its last ``len(steps)`` positions are the first
``len(steps)`` of the tail (in step order) and not yet in the pool or the slot table; all
earlier positions are.
"""

from __future__ import annotations

import mlx.core as mx

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

    def flush(self, pool: KVPool, device_table: mx.array) -> bool:
        """Write the tail into the pool and the slot table; False when it was empty."""
        steps = len(self.steps)
        taken = self.steps.take()
        if taken is None:
            return False
        rows, positions, slots = taken  # step-major, like the K/V below
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            assert k is not None and v is not None
            b, h, _, d = k.shape
            pool.write(layer, slots, k[:, :, :steps].transpose(2, 0, 1, 3).reshape(steps * b, h, d),
                       v[:, :, :steps].transpose(2, 0, 1, 3).reshape(steps * b, h, d))
        device_table[rows, positions] = slots
        self.clear()
        return True

    def clear(self) -> None:
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.steps.clear()
