"""Per-layer cache objects handed to mlx-lm models so their attention reads/writes the KV pool."""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
from mlx_lm.models.base import create_causal_mask

from runtime.worker.paths.cuda.decode_tail import DecodeTail
from runtime.worker.paths.cuda.window_view import cached_view
from runtime.worker.paths.paged_attention import PagedAttention
from runtime.worker.paths.prefill_shapes import front_padded_mask
from runtime.worker.paths.rows.row_cache import RowSpan
from runtime.worker.pools.kv_pool import KVPool


def decode_mask(valid: mx.array, rank: int) -> mx.array:
    """A (B, T) bool of the positions each row attends to, shaped to broadcast against the
    model's attention scores: (B, 1, 1, T) for rank 4, (B, 1, 1, 1, T) for queries grouped
    in 5-D (``CacheLayout.mask_rank``). The batch axis stays axis 0."""
    return valid.reshape((valid.shape[0],) + (1,) * (rank - 2) + (valid.shape[-1],))


def window_decode_mask(mask: mx.array, positions: int | mx.array, window: int) -> mx.array:
    """``mask`` (a ``decode_mask``) also hiding the positions a sliding-window layer no longer
    sees: a row at position p attends to p - window + 1 .. p, as mlx-lm's RotatingKVCache keeps."""
    if not isinstance(positions, int):
        positions = positions.reshape((positions.shape[0],) + (1,) * (mask.ndim - 1))
    return mask & (mx.arange(mask.shape[-1]) > positions - window)


def narrower(a: int | None, b: int | None) -> int | None:
    """The smaller of two windows, None meaning no window."""
    return b if a is None else a if b is None else min(a, b)


@dataclass(frozen=True)
class WindowGather:
    """A decode's K/V for sliding-window layers: ``index`` (B, window) holds each row's last
    ``window`` positions, as pool slots for the pool gather (padding slot 0 past a short row's
    length) or as positions for the row cache, ``mask`` (a ``decode_mask``) which of them are
    real. Such a layer reads its window, not the whole length."""

    window: int
    index: mx.array
    mask: mx.array


@dataclass
class ForwardBatch:
    """What one forward pass needs to address the pool.

    ``write_slots``: slot of every new token, batch-major (B * L,); None when the new K/V
    do not go to the pool in this forward (row-cache decode: they are copied there later).
    ``gather_index``: (B, T) slots of every position each row attends to, or None when
    the new tokens are the whole sequence (a prefill from position 0, single row).
    ``offset``: the position of the first new token (int for a prefill, (B,) array for decode).
    ``mask``: the decode mask (``decode_mask``: (B, 1, 1, T) bool, one more singleton axis for a
    model whose attention groups queries in 5-D), for a prefill whose gathered keys are padded
    at the front (``prefill_shapes.front_padded_mask`` of ``front_padding``: start, queries,
    keys), or None for a causal prefill and for
    a paged decode whose kernel takes ``lengths`` instead.
    ``rows``: where the new K/V also go in the row cache (and, for decode, what to attend to).
    ``lengths``/``attention``: set for a paged decode (the model's attention call is routed
    to ``PoolLayerCache.paged_attend``): valid positions per row, and the kernel to use;
    ``table``/``table_rows``: the device slot table and each batch row's row in it (kernel
    path; the fallback gathers through ``gather_index``); ``tail``: where a kernel-path decode
    puts its new K/V instead of the pool, and ``tail_len`` how many it holds before this step
    (an int32 array: ``DecodeTail.old_length``); ``launch``: the kernel's (splits, warps) for this
    batch, chosen once per step (``launch_shape``). ``window_gather``: a decode's narrowed K/V
    and mask for layers of that sliding window, or None. ``prefill_window``: a prefill chunk past
    position 0 whose layers of this window read from ``window_start`` on, as mlx-lm's
    RotatingKVCache keeps, not the whole prefix (nor the front padding of gathered keys).
    """

    write_slots: mx.array | None
    gather_index: mx.array | None
    offset: int | mx.array
    mask: mx.array | None
    lengths: mx.array | None = None
    attention: PagedAttention | None = None
    table: mx.array | None = None
    table_rows: mx.array | None = None
    tail: DecodeTail | None = None
    tail_len: mx.array | None = None
    rows: RowSpan | None = None
    launch: tuple[int, int] | None = None
    front_padding: tuple[int, int, int] | None = None
    window_masks: dict[int, mx.array] = field(default_factory=dict)
    window_views: dict[int, tuple[mx.array, mx.array, mx.array]] = field(default_factory=dict)
    window_gather: WindowGather | None = None
    prefill_window: int | None = None

    def window_start(self, window: int) -> int:
        """The first position a prefill chunk's layers of ``prefill_window`` read: the
        chunk's first query sees ``window`` positions back, no query any earlier one."""
        assert isinstance(self.offset, int)
        return max(0, self.offset - window + 1)

    @property
    def front_pad(self) -> int:
        """How many gathered key columns are padding before position 0 (``front_padding``)."""
        if self.front_padding is None:
            return 0
        start, length, keys = self.front_padding
        return keys - start - length

    def window_mask(self, window: int) -> mx.array:
        """``mask`` for a layer with a sliding window (built once per window and forward): a
        decode mask, or a prefill's over keys padded at the front (``front_padding``)."""
        assert self.mask is not None, "a sliding-window decode is always masked"
        if window not in self.window_masks:
            if self.front_padding is not None:
                self.window_masks[window] = front_padded_mask(*self.front_padding, self.mask.ndim, window)
            else:
                self.window_masks[window] = window_decode_mask(self.mask, self.offset, window)
        return self.window_masks[window]

    def kernel_view(self, window: int | None) -> tuple[mx.array, mx.array, mx.array]:
        """The kernel's (table, table rows, lengths) for a layer of this ``window`` (None: all
        positions; see ``window_view``), built once per window and forward."""
        assert self.table is not None and self.table_rows is not None and self.lengths is not None
        return cached_view(self.window_views, self.table, self.table_rows, self.lengths, window)


class CacheStandIn:
    """What mlx-lm asks of any layer cache beyond storing K/V: prompt-cache bookkeeping (nothing
    here), and ``keys_and_values()``, the K/V this forward's ``update_and_fetch`` returned (every
    position the layer attends to), which a layer reading another layer's K/V back through its
    cache calls after that layer stored them (Gemma 3n's KV-shared layers). A view that returns
    only the step's new K/V (the paged decode) leaves ``fetched`` unset: reading it fails there."""

    fetched: tuple[mx.array, mx.array] | None = None

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        assert self.fetched is not None, "keys_and_values() of a cache that returned no full K/V this forward"
        return self.fetched

    @property
    def state(self):
        return []

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False


class PoolLayerCache(CacheStandIn):
    """Stands in for mlx-lm's KVCache (or, with a ``window``, its RotatingKVCache) in one
    attention layer during one forward pass."""

    def __init__(self, pool: KVPool, kv_layer: int, batch: ForwardBatch, window: int | None = None) -> None:
        self.pool = pool
        self.kv_layer = kv_layer
        self.batch = batch
        self.window = window
        self.new: tuple[mx.array, mx.array] | None = None  # this step's K/V

    @property
    def offset(self) -> int | mx.array:
        return self.batch.offset

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        fetched = self._store(keys, values)
        # A paged decode returns the step's new K/V alone: nothing a later reader may take as all.
        self.fetched = None if self.paged or self.batch.tail is not None else fetched
        return fetched

    def _store(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        b, h, length, _ = keys.shape
        self.new = (keys, values)  # paged_attend's kernel reads this step's K/V from here
        if self.batch.tail is not None:
            return keys, values  # paged_attend reads the pool and the tail, and appends to the tail
        if self.batch.write_slots is not None:
            if length == 1:  # decode: a plain slice, no transpose to copy
                flat_k, flat_v = keys[:, :, 0, :], values[:, :, 0, :]
            else:
                flat_k = keys.transpose(0, 2, 1, 3).reshape(b * length, h, keys.shape[3])
                flat_v = values.transpose(0, 2, 1, 3).reshape(b * length, h, values.shape[3])
            self.pool.write(self.kv_layer, self.batch.write_slots, flat_k, flat_v)
        narrowed = self.batch.window_gather
        window_columns = narrowed.index if narrowed is not None and self.window == narrowed.window else None
        window = self.batch.prefill_window
        first = self.batch.window_start(window) if window is not None and self.window == window else 0
        if self.batch.rows is not None:
            dense = self.batch.rows.write(self.kv_layer, keys, values, window_columns, first)
            if dense is not None:
                return dense
        if self.paged:
            # The attention call comes back to paged_attend, which reads the pool itself.
            return keys, values
        if self.batch.gather_index is None:
            # The new tokens are the whole sequence: attend to them directly, as mlx-lm's KVCache does.
            return keys, values
        if window_columns is not None:
            return self.pool.gather(self.kv_layer, window_columns)
        if first:  # a prefill chunk's windowed layer: its window back, not the whole prefix
            return self.pool.gather(self.kv_layer, self.batch.gather_index[:, self.batch.front_pad + first:])
        return self.pool.gather(self.kv_layer, self.batch.gather_index)

    @property
    def paged(self) -> bool:
        return self.batch.attention is not None

    def paged_attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        """Decode attention over this row's pool slots (the K/V just written included), with
        the model's attention ``sinks`` if it has them."""
        b, layer = self.batch, self.kv_layer
        assert b.attention is not None and b.lengths is not None
        if b.table is None:
            assert b.gather_index is not None, "without the kernel, decode attends to gathered slots"
            return b.attention.attend(queries, self.pool, layer, scale, b.gather_index, b.mask, sinks)
        assert b.table_rows is not None and self.new is not None
        tail = b.tail
        assert tail is not None, "the kernel path decodes through a decode tail"
        b_rows, n_kv, _, head_dim = self.new[0].shape
        keys, values = tail.old(b_rows, n_kv, head_dim, self.new[0].dtype)
        table, table_rows, lengths = b.kernel_view(self.window)
        out, keys, values = b.attention.attend_appending(
            queries, self.pool.keys[layer], self.pool.values[layer], table, table_rows, lengths, keys[layer],
            values[layer], b.tail_len, *self.new, scale, b.launch, sinks=sinks)
        tail.set(layer, keys, values)
        return out

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None):
        # A RotatingKVCache windows its mask by its own size when the model names no window.
        window = narrower(window_size, self.window)
        if self.paged:
            return None  # the kernel takes each row's length (and a window's narrowed table)
        narrowed = self.batch.window_gather
        if narrowed is not None and window == narrowed.window:
            return narrowed.mask  # over the window's gathered K/V (``_store``)
        offset = self.batch.offset
        if window is not None and window == self.batch.prefill_window:
            # Over the keys from window_start on (``_store``; front padding, if any, before them
            # is not read): the same windows, shifted.
            assert isinstance(offset, int)
            first = self.batch.window_start(window)
            if first or self.batch.mask is None:
                return create_causal_mask(n, offset - first, window_size=window)
        if self.batch.mask is not None:
            return self.batch.mask if window is None else self.batch.window_mask(window)
        if window is not None and (n > 1 or offset >= window):
            assert isinstance(offset, int), "a sliding-window decode is always masked"
            return create_causal_mask(n, offset, window_size=window)
        if n == 1:
            return None
        if return_array:
            assert isinstance(offset, int)
            return create_causal_mask(n, offset)
        return "causal"
