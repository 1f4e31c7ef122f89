"""The paged kernel's inputs for a sliding-window layer: the same kernel over a narrower table.

The kernel attends to positions ``0..lengths[b]-1`` of row ``rows[b]`` of ``table`` (the last
R of them from the decode tail). A layer with a sliding window of W attends to the last W
positions only, as mlx-lm's RotatingKVCache keeps them. So such a layer gets a (B, W) table
whose row b holds the slots of positions ``max(0, lengths[b] - W)..``, its rows in batch
order, and lengths ``min(lengths[b], W)``: the kernel then reads exactly the window, and its
tail (always the newest R <= W positions) as before. One gather of B x W ints per window and
step, shared by every layer of that window; the kernel itself is unchanged.
"""

from __future__ import annotations

import mlx.core as mx


def window_view(table: mx.array, table_rows: mx.array, lengths: mx.array, window: int
                ) -> tuple[mx.array, mx.array, mx.array]:
    """(table, rows, lengths) for the kernel to attend to each row's last ``window`` positions.

    ``table``: (rows, capacity) slots; ``table_rows``: (B,) each batch row's row in it;
    ``lengths``: (B,) int32 positions each row attends to in full.
    """
    capacity = table.shape[1]
    first = mx.maximum(lengths - window, 0)  # the oldest position the window keeps
    # Positions past a row's length are clipped into the table; the kernel never reads them.
    columns = mx.minimum(first[:, None] + mx.arange(window, dtype=mx.int32)[None, :], capacity - 1)
    flat = table_rows[:, None].astype(mx.int32) * capacity + columns
    narrow = mx.take(table.reshape(-1), flat)
    rows = mx.arange(lengths.shape[0], dtype=mx.int32)
    return narrow, rows, mx.minimum(lengths, window)


KernelInputs = tuple[mx.array, mx.array, mx.array]


def cached_view(views: dict[int, KernelInputs], table: mx.array, table_rows: mx.array, lengths: mx.array,
                window: int | None) -> KernelInputs:
    """The kernel's (table, rows, lengths) for a layer of ``window`` (None: every position), each
    window's view built once into ``views`` (one forward's, or one trace's)."""
    if window is None:
        return table, table_rows, lengths
    if window not in views:
        views[window] = window_view(table, table_rows, lengths, window)
    return views[window]
