"""The K/V of the last few decode steps, kept out of the KV pool until the batch changes.

MLX updates an array in place only when nothing else holds it; a step still on the device
holds the pools it reads. If every decode step wrote its new K/V into the pool, step N+1
could only be submitted after step N was read back (else MLX copies the whole pool on each
write), and the device would wait for the host to encode every step. With the tail, a decode
step writes nothing in place: its new K/V are appended to these small per-batch arrays,
which the paged kernel reads after the pool positions. The tail is flushed into the pool
(and the device slot table) by the first step that changes the batch — new rows, a prefill,
a row that left — or after ``max_steps`` steps; only such a step waits for the read-back.

Invariant: for every row of ``rows``, positions ``length - len(steps) .. length - 1`` are in
the tail (in step order) and not yet in the pool; all earlier positions are in the pool.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.worker.kv_pool import KVPool


class DecodeTail:
    """Per-layer (B, n_kv_heads, steps, head_dim) K/V of the current decode batch."""

    def __init__(self, num_layers: int, max_steps: int) -> None:
        self.max_steps = max_steps
        self.keys: list[mx.array | None] = [None] * num_layers
        self.values: list[mx.array | None] = [None] * num_layers
        self.batch_key: tuple | None = None
        self._steps: list[tuple[mx.array, mx.array, mx.array]] = []  # (table rows, positions, slots)

    def __len__(self) -> int:
        return len(self._steps)

    def continues(self, batch_key: tuple) -> bool:
        """Whether a decode batch identified by ``batch_key`` may append to this tail."""
        return bool(self._steps) and batch_key == self.batch_key and len(self._steps) < self.max_steps

    def start_step(self, batch_key: tuple, table_rows: mx.array, positions: mx.array, slots: mx.array) -> None:
        """Open the next step; its K/V arrive layer by layer through ``append``."""
        assert not self._steps or batch_key == self.batch_key, "flush before changing the batch"
        self.batch_key = batch_key
        self._steps.append((table_rows, positions, slots))

    def append(self, layer: int, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        """Add one step's (B, n_kv_heads, 1, head_dim) K/V; return the layer's whole tail."""
        old_k, old_v = self.keys[layer], self.values[layer]
        if old_k is None:  # the first step since a flush
            self.keys[layer], self.values[layer] = keys, values
        else:
            assert old_k.shape[2] == len(self._steps) - 1, "one append per layer and step"
            self.keys[layer] = mx.concatenate([old_k, keys], axis=2)
            self.values[layer] = mx.concatenate([old_v, values], axis=2)
        return self.keys[layer], self.values[layer]

    def flush(self, pool: KVPool, device_table: mx.array | None) -> bool:
        """Write the tail into the pool and the slot table; False when it was empty."""
        if not self._steps:
            return False
        slots = mx.concatenate([s for _, _, s in self._steps])  # step-major, like the K/V below
        for layer, (k, v) in enumerate(zip(self.keys, self.values)):
            assert k is not None and v is not None
            b, h, steps, d = k.shape
            pool.write(layer, slots, k.transpose(2, 0, 1, 3).reshape(steps * b, h, d),
                       v.transpose(2, 0, 1, 3).reshape(steps * b, h, d))
        if device_table is not None:
            rows = mx.concatenate([r for r, _, _ in self._steps])
            positions = mx.concatenate([p for _, p, _ in self._steps])
            device_table[rows, positions] = slots
        self.clear()
        return True

    def clear(self) -> None:
        self.keys = [None] * len(self.keys)
        self.values = [None] * len(self.values)
        self.batch_key = None
        self._steps = []
