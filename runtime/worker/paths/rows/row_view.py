"""What one traced row-cache decode step hands the model's attention layers: a stand-in for
mlx-lm's KV cache per layer (``RowView``) over the arrays every layer shares (``StepArrays``:
rows, positions, the attended length, masks, each row's sliding-window positions)."""

from __future__ import annotations

import mlx.core as mx

from runtime.worker.paths.pool_cache import CacheStandIn, decode_mask, narrower, window_decode_mask
from runtime.worker.paths.rows import row_attention
from runtime.worker.paths.rows.parallel_attention import RowSplit
from runtime.worker.paths.rows.row_cache import read_windows


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
        if self.window in s.gathers:  # a sliding-window layer reads each row's own window
            rows = mx.arange(keys.shape[0]) if s.compact else s.rows
            self.fetched = read_windows(self.keys, self.values, rows, self.heads, s.gathers[self.window])
        elif s.compact:
            b = keys.shape[0]
            self.fetched = self.keys[:b, :, : s.length, :], self.values[:b, :, : s.length, :]
        else:
            self.fetched = self.keys[s.rows, :, : s.length, :], self.values[s.rows, :, : s.length, :]
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
    for each sliding window shorter than that length (``gathered``) each row's last ``window``
    positions, which its layers gather (``gathers``) and attend to under ``window_mask``."""

    def __init__(self, rows: mx.array, positions: mx.array, compact: bool, length: int,
                 fold: bool, split: RowSplit | None, mask_rank: int = 4, gathered: tuple[int, ...] = ()) -> None:
        self.rows, self.positions = rows, positions
        self.compact, self.length, self.fold = compact, length, fold
        self.mask_rank = mask_rank
        self.split = split
        self.parts = split.parts(rows.shape[0]) if split is not None else 1
        self.row_index, self.position_index = rows[:, None], positions[:, None]  # scatter (row, head, position)
        index = mx.arange(length)[None, :]
        # (B, 1, 1, length) bool (rank 5 for 5-D grouped queries): each row sees the positions up to its own.
        self.mask = decode_mask(index <= positions[:, None], mask_rank)
        self.window_masks: dict[tuple[int, int | None], mx.array] = {}
        # (B, W): each row's last W positions, clipped at 0 (the mask hides those before 0).
        self.gathers = {w: mx.maximum(self._window_positions(w), 0) for w in gathered}

    def _window_positions(self, window: int) -> mx.array:
        """(B, window): the positions p - window + 1 .. p of each row at p."""
        return self.positions[:, None] - (window - 1) + mx.arange(window)[None, :]

    def window_mask(self, window: int, gathered_by: int | None = None) -> mx.array:
        """The mask of a layer with a sliding window (built once per window and trace), over the
        positions ``gathered_by``'s layers gather where that window is gathered, else over the
        whole attended length."""
        if (window, gathered_by) not in self.window_masks:
            if gathered_by in self.gathers:
                index = self._window_positions(gathered_by)
                mask = decode_mask((index >= 0) & (index > self.positions[:, None] - window), self.mask_rank)
            else:
                mask = window_decode_mask(self.mask, self.positions, window)
            self.window_masks[(window, gathered_by)] = mask
        return self.window_masks[(window, gathered_by)]
