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

Invariant: for every row of the batch, its last ``len(steps)`` positions are in the tail (in
step order) and not yet in the pool or the slot table; all earlier positions are.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.worker.paths.deferred_steps import DeferredSteps
from runtime.worker.pools.kv_pool import KVPool


class DecodeTail:
    """Per-layer (B, n_kv_heads, steps, head_dim) K/V of the current decode batch."""

    def __init__(self, num_layers: int, max_steps: int) -> None:
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.steps = DeferredSteps(max_steps)

    def set(self, layer: int, keys: mx.array, values: mx.array) -> None:
        """Make (B, n_kv_heads, steps, head_dim) K/V, ending with the current step's, the
        layer's tail (the paged kernel writes them while it attends)."""
        assert keys.shape[2] == len(self.steps), "one step's K/V per layer and step"
        self.keys[layer], self.values[layer] = keys, values

    def flush(self, pool: KVPool, device_table: mx.array) -> bool:
        """Write the tail into the pool and the slot table; False when it was empty."""
        taken = self.steps.take()
        if taken is None:
            return False
        rows, positions, slots = taken  # step-major, like the K/V below
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            assert k is not None and v is not None
            b, h, steps, d = k.shape
            pool.write(layer, slots, k.transpose(2, 0, 1, 3).reshape(steps * b, h, d),
                       v.transpose(2, 0, 1, 3).reshape(steps * b, h, d))
        device_table[rows, positions] = slots
        self.clear()
        return True

    def clear(self) -> None:
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.steps.clear()
