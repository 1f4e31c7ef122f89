"""One-token attention of a decode batch split by rows over several MLX CPU streams.

MLX runs a CPU stream's operations on one thread, and the decode step of a batch is mostly
attention once it has a few rows (the tiny bench model at 16 rows: half the step). Each
row's attention is independent of the others (per-row matrix products, a per-row softmax),
so computing groups of rows on separate streams, each its own thread, gives bit-identical
results. Measured on a 2-CPU VM, 16 rows x 416 positions: 1.8-1.9 ms on one stream,
0.7-0.95 ms on two; under 8 rows the extra synchronisation costs more than it saves.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

MIN_ROWS = 4  # rows per stream, at least
MAX_STREAMS = 4

Attend = Callable[[mx.array, mx.array, mx.array, float, mx.array], mx.array]


def streams_on(on_cpu: bool, streams: int) -> int:
    """The streams a compiled row step splits attention over on this device: on a GPU one, for
    the extra streams are CPU streams, so a split would move most rows' attention onto host
    threads (Gemma 3 1B on an H100, 16 rows: 140 ms steps, three CPU threads busy; session 33)."""
    return streams if on_cpu else 1


def default_streams(cpu_count: int | None) -> int:
    """Streams for ``worker.attention_threads = 0``: one per CPU, at most ``MAX_STREAMS``."""
    return max(1, min(MAX_STREAMS, cpu_count or 1))


class RowSplit:
    """``attend(...)`` over ``parts(rows)`` groups of rows, one per CPU stream."""

    def __init__(self, streams: int) -> None:
        assert streams >= 2, "a split needs at least two streams"
        self.extra = [mx.new_stream(mx.cpu) for _ in range(streams - 1)]

    def parts(self, rows: int) -> int:
        """How many groups a batch of ``rows`` rows is split into (1: not split)."""
        return max(1, min(len(self.extra) + 1, rows // MIN_ROWS))

    def attend(self, attend: Attend, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
               mask: mx.array, parts: int) -> mx.array:
        """``attend`` on each group of rows (the first on the current stream), concatenated.

        ``queries`` (B, H, 1, D); ``keys``/``values`` (B, KV, T, D); ``mask`` (B, 1, 1, T).
        """
        rows = queries.shape[0]
        bounds = [rows * i // parts for i in range(parts + 1)]
        outs = []
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            group = (queries[lo:hi], keys[lo:hi], values[lo:hi], scale, mask[lo:hi])
            if i == 0:
                outs.append(attend(*group))
            else:
                with mx.stream(self.extra[i - 1]):
                    outs.append(attend(*group))
        return mx.concatenate(outs, axis=0)
