"""What one traced row-cache decode step hands the model's attention layers: a stand-in for
mlx-lm's KV cache per layer (``RowView``) over the arrays every layer shares (``StepArrays``:
rows, positions, the attended length, masks, sliding-window spans)."""

from __future__ import annotations

import mlx.core as mx

from runtime.worker.paths.pool_cache import CacheStandIn, decode_mask, narrower, window_decode_mask
from runtime.worker.paths.rows import row_attention
from runtime.worker.paths.rows.parallel_attention import RowSplit


class RowView(CacheStandIn):
    """Stands in for mlx-lm's KVCache (RotatingKVCache with a ``window``) in one attention
    layer inside the traced forward."""

    def __init__(self, keys: mx.array, values: mx.array, heads: mx.array, step: StepArrays,
                 window: int | None = None) -> None:
        self.keys, self.values, self.heads, self.step, self.window = keys, values, heads, step, window

    @property
    def offset(self) -> mx.array:
        return self.step.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        s = self.step
        self.keys[s.row_index, self.heads, s.position_index] = keys[:, :, 0, :]
        self.values[s.row_index, self.heads, s.position_index] = values[:, :, 0, :]
        if s.compact:
            b = keys.shape[0]
            fetched = self.keys[:b, :, : s.length, :], self.values[:b, :, : s.length, :]
        else:
            fetched = self.keys[s.rows, :, : s.length, :], self.values[s.rows, :, : s.length, :]
        part = s.window_slice(self.window)
        if part is not None:  # a sliding-window layer reads the span that holds every row's window
            start, span = part
            fetched = tuple(mx.slice(a, start, [2], (a.shape[0], a.shape[1], span, a.shape[3])) for a in fetched)
        self.fetched = fetched
        return self.fetched

    @property
    def attends_decode(self) -> bool:
        """Whether the attention dispatcher should call ``decode_attend``: heads folded (see
        ``folded_attention``) or rows split over CPU streams (``RowSplit``)."""
        return self.step.fold or self.step.parts > 1

    def decode_attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: mx.array) -> mx.array:
        s = self.step
        # Folding is checked exact for boolean masks over one width (not DeepSeek-V3's float
        # rotary-score mask over its latent).
        fold = s.fold and mask.dtype == mx.bool_ and values.shape[-1] == queries.shape[-1]
        attend = row_attention.folded_attention if fold else row_attention.mlx_attention
        if s.parts > 1:
            assert s.split is not None
            return s.split.attend(attend, queries, keys, values, scale, mask, s.parts)
        return attend(queries, keys, values, scale, mask)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        window = narrower(window_size, self.window)
        return self.step.mask if window is None else self.step.window_mask(window, self.window)


class StepArrays:
    """What every layer of one traced step shares: rows, positions, attended length, mask, and
    for each sliced sliding window its span's first position (``starts``, an input array, one per
    window of ``spans``) and length."""

    def __init__(self, rows: mx.array, positions: mx.array, compact: bool, length: int,
                 fold: bool, split: RowSplit | None, mask_rank: int = 4,
                 spans: tuple[tuple[int, int], ...] = (), starts: mx.array | None = None) -> None:
        self.rows, self.positions = rows, positions
        self.compact, self.length, self.fold = compact, length, fold
        self.mask_rank = mask_rank
        assert (starts is None) == (not spans)
        self.slices = {window: (starts[i : i + 1], span) for i, (window, span) in enumerate(spans)}
        self.split = split
        self.parts = split.parts(rows.shape[0]) if split is not None else 1
        self.row_index, self.position_index = rows[:, None], positions[:, None]  # scatter (row, head, position)
        index = mx.arange(length)[None, :]
        # (B, 1, 1, length) bool (rank 5 for 5-D grouped queries): each row sees the positions up to its own.
        self.mask = decode_mask(index <= positions[:, None], mask_rank)
        self.window_masks: dict[tuple[int, int | None], mx.array] = {}

    def window_slice(self, window: int | None) -> tuple[mx.array, int] | None:
        """(first position as a 1-element array, span) a layer of this window reads, or None: all."""
        return self.slices.get(window) if window is not None else None

    def window_mask(self, window: int, sliced_by: int | None = None) -> mx.array:
        """The mask of a layer with a sliding window (built once per window and trace), over the
        span of ``sliced_by``'s slice where that window is sliced."""
        if (window, sliced_by) not in self.window_masks:
            part = self.window_slice(sliced_by)
            if part is None:
                mask = window_decode_mask(self.mask, self.positions, window)
            else:
                start, span = part
                index = start + mx.arange(span)[None, :]
                # A padding row (at the scratch position, past the span) sees the span's last
                # ``window`` positions rather than none (its output is dropped).
                lowest = mx.minimum(self.positions, start + span - 1)[:, None] - window
                mask = decode_mask((index <= self.positions[:, None]) & (index > lowest), self.mask_rank)
            self.window_masks[(window, sliced_by)] = mask
        return self.window_masks[(window, sliced_by)]
