"""Row-cache decode as one compiled MLX function (``mx.compile``), per batch shape.

A decode step of the row-cache path (the CPU's) is host-bound for small models: Python builds
a graph of a few hundred small operations every step, and MLX's CPU stream runs only about a
hundred operations ahead of the host, so any host work between steps (the socket, the next
plan) leaves the device idle. Compiled, the model forward is traced once per shape: each step
replays the trace (no Python per layer) and elementwise chains are fused into single kernels,
so the step is fewer, larger operations. Measured on a 2-CPU VM with the tiny bench model:
0.09 ms of host build instead of 0.23, and 1.89 ms per step instead of 2.38 ms when the host
has 0.3 ms of other work per step.

Shapes must recur for a trace to be reused, so attention reads a bucketed length
(``length_bucket`` multiples) with a mask, rather than exactly the positions in use, and the
new K/V are scattered at (row, position) arrays rather than sliced at Python ints.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.discovery import CacheLayout
from runtime.worker.row_cache import RowCache


class _RowView:
    """Stands in for mlx-lm's KVCache in one attention layer inside the traced forward."""

    def __init__(self, keys: mx.array, values: mx.array, step: _StepArrays) -> None:
        self.keys, self.values, self.step = keys, values, step

    @property
    def offset(self) -> mx.array:
        return self.step.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        s = self.step
        self.keys[s.row_index, s.heads, s.position_index] = keys[:, :, 0, :]
        self.values[s.row_index, s.heads, s.position_index] = values[:, :, 0, :]
        if s.compact:
            b = keys.shape[0]
            return self.keys[:b, :, : s.length, :], self.values[:b, :, : s.length, :]
        return self.keys[s.rows, :, : s.length, :], self.values[s.rows, :, : s.length, :]

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        assert window_size is None, "sliding-window models are refused at discovery"
        return self.step.mask

    @property
    def state(self) -> list:
        return []

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class _StepArrays:
    """What every layer of one traced step shares: rows, positions, attended length, mask."""

    def __init__(self, rows: mx.array, positions: mx.array, heads: mx.array, compact: bool, length: int) -> None:
        self.rows, self.positions, self.heads = rows, positions, heads
        self.compact, self.length = compact, length
        self.row_index, self.position_index = rows[:, None], positions[:, None]  # scatter (row, head, position)
        index = mx.arange(length)[None, :]
        # (B, 1, 1, length) bool: each row sees the positions up to its own.
        self.mask = (index <= positions[:, None])[:, None, None, :]


class CompiledDecode:
    """The model's decode forward over a ``RowCache``, compiled once per (rows, length bucket).

    ``forward`` takes the batch's input tokens, row indices and positions, writes the new
    K/V into the row cache (its arrays are replaced by the compiled function's outputs) and
    returns the last-position logits. Only for models whose every layer is attention.
    """

    def __init__(self, model: nn.Module, layout: CacheLayout, row_cache: RowCache, length_bucket: int,
                 max_context: int) -> None:
        assert all(i >= 0 for i in layout.kv_index), "compiled decode needs every layer to be attention"
        self.model = model
        self.kv_index = list(layout.kv_index)
        self.row_cache = row_cache
        self.length_bucket = length_bucket
        self.max_context = max_context
        self._fn = mx.compile(self._forward)

    @staticmethod
    def supports(layout: CacheLayout) -> bool:
        return bool(layout.kv_index) and all(i >= 0 for i in layout.kv_index)

    def bucket(self, length: int) -> int:
        """The attended length for a batch whose longest row needs ``length`` positions."""
        return min(-(-length // self.length_bucket) * self.length_bucket, self.max_context)

    def _forward(self, tokens: mx.array, rows: mx.array, positions: mx.array, keys: list[mx.array],
                 values: list[mx.array], compact: bool, length: int):
        step = _StepArrays(rows, positions, self.row_cache.heads, compact, length)
        views = [_RowView(k, v, step) for k, v in zip(keys, values)]
        logits = self.model(tokens[:, None], cache=[views[i] for i in self.kv_index])[:, -1, :]
        return logits, [v.keys for v in views], [v.values for v in views]

    def trace(self, rows: int) -> int:
        """Trace (without running) the compact step of ``rows`` rows at every length bucket, so
        no request waits for those traces later; how many."""
        tokens = mx.zeros((rows,), dtype=mx.int32)
        index = mx.arange(rows, dtype=mx.int32)
        c = self.row_cache
        lengths = range(self.length_bucket, self.max_context + self.length_bucket, self.length_bucket)
        for length in lengths:
            self._fn(tokens, index, index, c.keys, c.values, True, min(length, self.max_context))  # outputs dropped
        return len(lengths)

    def forward(self, tokens: mx.array, rows: mx.array, positions: mx.array, compact: bool, length: int) -> mx.array:
        """Logits (B, vocab) of one decode step; the row cache holds the step's K/V afterwards."""
        c = self.row_cache
        logits, keys, values = self._fn(tokens, rows, positions, c.keys, c.values, compact, self.bucket(length))
        c.keys[:], c.values[:] = keys, values
        return logits
