"""A dense K/V copy per request row, so decode attention reads contiguous memory.

Used where the paged decode kernel is not available (the CPU; on a GPU, models the kernel
does not take) and the copy fits in ``MAX_BYTES`` (the CPU's default rows are chosen so that
it does, ``defaults.device_rows``): there, gathering every
row's K/V out of the pool each step and making it contiguous costs as much as the rest of
the step. The pool stays the source of truth for the prefix cache (prefill writes it, and
decode K/V are copied there before anything reads it, see ``AttentionPaths``); the row cache
holds the running rows' K/V laid out as mlx-lm's KVCache does, (rows, kv_heads, max_context,
head_dim), so a decode batch whose rows are exactly ``0..B-1`` attends to a slice of it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import mlx.core as mx

from runtime.worker.defaults import ROW_CACHE_BYTES
from runtime.worker.model.discovery import AttentionShape
from runtime.worker.pools.kv_pool import KVPool, layer_shapes

MAX_BYTES = ROW_CACHE_BYTES  # a larger copy is not made: decode gathers from the pool instead


def read_windows(keys: mx.array, values: mx.array, rows: mx.array, heads: mx.array,
                 columns: mx.array) -> tuple[mx.array, mx.array]:
    """(B, KV heads, W, width) K/V of each batch row at its ``columns`` (B, W) positions, out of
    a layer's row-cache arrays (rows, KV heads, positions, width): ``rows`` (B,) the batch's rows,
    ``heads`` (1, KV heads). How a sliding-window layer reads its window alone."""
    index = (rows[:, None, None], heads[:, :, None], columns[:, None, :])
    return keys[index], values[index]


class RowCache:
    """``keys[i]``/``values[i]``: (rows, n_kv_heads, max_context, width) for KV layer i, at that
    layer's own shape (``KVPool``'s per-layer shapes; keys and values of their own widths, see
    ``AttentionShape``); ``heads[i]``: (1, n_kv_heads) head indices of layer i, one array per
    distinct head count.

    A row's positions past its current length hold stale data; decode masks them out.
    """

    SCRATCH = 1  # positions past max_context: where a decode step's padding rows write (never attended)

    def __init__(self, num_layers: int, rows: int, max_context: int,
                 shape: AttentionShape | Sequence[AttentionShape], dtype: mx.Dtype) -> None:
        self.rows, self.max_context = rows, max_context
        shapes = layer_shapes(num_layers, shape)
        dims = [(rows, s.n_kv_heads, max_context + self.SCRATCH) for s in shapes]
        self.keys = [mx.zeros(d + (s.head_dim,), dtype=dtype) for d, s in zip(dims, shapes)]
        self.values = [mx.zeros(d + (s.value_width,), dtype=dtype) for d, s in zip(dims, shapes)]
        by_count = {n: mx.arange(n)[None, :] for n in sorted({s.n_kv_heads for s in shapes})}
        self.heads = [by_count[s.n_kv_heads] for s in shapes]
        mx.eval(self.keys, self.values, self.heads)

    def zero(self) -> None:
        """Fresh zeroed arrays, in the same lists (a failed step may have left its outputs here;
        the pool, the source of truth, refills rows as requests are admitted)."""
        self.keys[:] = [mx.zeros(k.shape, dtype=k.dtype) for k in self.keys]
        self.values[:] = [mx.zeros(v.shape, dtype=v.dtype) for v in self.values]
        mx.eval(self.keys, self.values)

    @staticmethod
    def nbytes_for(num_layers: int, rows: int, max_context: int, shape: AttentionShape | Sequence[AttentionShape],
                   dtype: mx.Dtype) -> int:
        positions = max_context + RowCache.SCRATCH
        return rows * positions * KVPool.bytes_per_slot(num_layers, shape, dtype)

    def arrays(self) -> list[mx.array]:
        return self.keys + self.values

    def flush(self, pool: KVPool, rows: mx.array, positions: mx.array, slots: mx.array) -> None:
        """Copy the K/V at (``rows[i]``, ``positions[i]``) into pool slot ``slots[i]``."""
        r, p = rows[:, None], positions[:, None]
        for layer in range(len(self.keys)):
            heads = self.heads[layer]
            pool.write(layer, slots, self.keys[layer][r, heads, p], self.values[layer][r, heads, p])

    def fill_prefix(self, pool: KVPool, row: int, slots: mx.array) -> None:
        """Copy a cached prefix's K/V (pool ``slots``, positions 0..) into ``row``."""
        n = slots.shape[0]
        for layer in range(len(self.keys)):
            self.keys[layer][row, :, :n, :] = pool.keys[layer][slots].transpose(1, 0, 2)
            self.values[layer][row, :, :n, :] = pool.values[layer][slots].transpose(1, 0, 2)


@dataclass
class RowSpan:
    """Where one forward's new K/V go in the row cache, and what decode attends to.

    Prefill (not ``decode``): rows ``rows`` receive positions ``start..start+L``; a chunk
    past position 0 attends to the row cache's positions ``0..start+L``.
    Decode: row ``rows[b]`` receives position ``positions[b]`` (or ``same_position`` for
    all); attention reads the first ``length`` positions of those rows (a slice when
    ``compact``: rows are ``0..B-1`` in order).
    """

    cache: RowCache
    rows: list[int]
    start: int = 0
    positions: mx.array | None = None
    rows_array: mx.array | None = None
    length: int = 0
    compact: bool = False
    same_position: int | None = None
    decode: bool = False

    def __post_init__(self) -> None:
        # Index arrays shared by every layer (built once per forward).
        if self.positions is not None and self.rows_array is not None:
            self._r, self._p = self.rows_array[:, None], self.positions[:, None]
        if not self.decode and len(self.rows) > 1:
            self.rows_array = mx.array(self.rows, dtype=mx.int32)

    def write(self, layer: int, keys: mx.array, values: mx.array, window_columns: mx.array | None = None,
              first: int = 0) -> tuple[mx.array, mx.array] | None:
        """Store the new K/V ((B, n_kv_heads, L, head_dim)) and return what to attend to: for
        decode the attended length, or a sliding-window layer's (B, W) ``window_columns`` alone;
        for a prefill chunk past position 0 its prefix from position ``first`` on, and itself."""
        c = self.cache
        if not self.decode:
            n = keys.shape[2]
            for i, row in enumerate(self.rows):
                c.keys[layer][row, :, self.start : self.start + n, :] = keys[i]
                c.values[layer][row, :, self.start : self.start + n, :] = values[i]
            if self.start == 0:
                return None  # the new tokens are the whole sequence
            # A later chunk attends to its rows' cached prefix and itself, already in place.
            end = self.start + n
            if len(self.rows) == 1:
                row = self.rows[0]
                return c.keys[layer][row : row + 1, :, first:end, :], c.values[layer][row : row + 1, :, first:end, :]
            return (c.keys[layer][:, :, first:end, :][self.rows_array],
                    c.values[layer][:, :, first:end, :][self.rows_array])
        b = len(self.rows)
        if self.same_position is not None:
            # Rows 0..B-1 all at one position (a batch in lockstep, so compact): one slice update.
            pos = self.same_position
            c.keys[layer][:b, :, pos : pos + 1, :] = keys
            c.values[layer][:b, :, pos : pos + 1, :] = values
        else:
            c.keys[layer][self._r, c.heads[layer], self._p] = keys[:, :, 0, :]
            c.values[layer][self._r, c.heads[layer], self._p] = values[:, :, 0, :]
        if window_columns is not None:
            rows = mx.arange(b) if self.compact else self.rows_array
            return read_windows(c.keys[layer], c.values[layer], rows, c.heads[layer], window_columns)
        if self.compact:
            return c.keys[layer][:b, :, : self.length, :], c.values[layer][:b, :, : self.length, :]
        return c.keys[layer][:, :, : self.length, :][self.rows_array], c.values[layer][:, :, : self.length, :][self.rows_array]
