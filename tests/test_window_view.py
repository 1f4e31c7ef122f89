"""The paged kernel's narrowed table for sliding-window layers (``window_view``), and which
windowed models take the kernel path.

The kernel reads positions ``0..n-1`` (n = length - R) of its table row from the pool and the
last R from the decode tail; these tests replay that reading on the view's arrays and check it
is exactly the window mlx-lm's RotatingKVCache keeps. The kernel itself runs only on a CUDA GPU
(``tests/test_window_view_cuda.py``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime.worker.paths.cuda.window_view import window_view


def _read_positions(table: np.ndarray, rows: np.ndarray, lengths: np.ndarray, tail: int) -> list[list[int]]:
    """What the kernel reads per batch row: pool slots by its table row, then ``tail`` tail entries."""
    out = []
    for b in range(len(lengths)):
        n = int(lengths[b]) - tail
        out.append([int(s) for s in table[rows[b], :n]] + [-1] * tail)
    return out


@pytest.mark.parametrize("window", [17, 32, 100])
@pytest.mark.parametrize("tail", [1, 5, 16])
def test_the_view_reads_exactly_each_rows_window(window, tail):
    rng = np.random.default_rng(window * 31 + tail)
    capacity, table_rows = 300, 9
    # Slot of position p of table row r: unique, so a read names the position it came from.
    table = (np.arange(table_rows)[:, None] * 1000 + np.arange(capacity)[None, :]).astype(np.int32)
    batch_rows = rng.permutation(table_rows)[:6].astype(np.int32)
    lengths = np.array([tail, tail + 1, window - 1, window, window + 1, capacity], dtype=np.int32)
    narrow, rows, short = window_view(mx.array(table), mx.array(batch_rows), mx.array(lengths), window)
    assert narrow.shape == (6, window) and narrow.dtype == mx.int32
    read = _read_positions(np.array(narrow), np.array(rows), np.array(short), tail)
    for b, length in enumerate(lengths):
        first = max(0, int(length) - window)
        expected = [int(batch_rows[b]) * 1000 + p for p in range(first, int(length) - tail)] + [-1] * tail
        assert read[b] == expected, (b, int(length))


def test_a_window_wider_than_the_table_reads_every_position():
    table = np.arange(2 * 40, dtype=np.int32).reshape(2, 40)
    lengths = np.array([40, 7], dtype=np.int32)
    narrow, rows, short = window_view(mx.array(table), mx.array([1, 0], dtype=mx.int32), mx.array(lengths), 64)
    assert np.array(short).tolist() == [40, 7]
    read = _read_positions(np.array(narrow), np.array(rows), np.array(short), 1)
    assert read[0] == list(range(40, 79)) + [-1]
    assert read[1] == list(range(0, 6)) + [-1]
