"""Timing records and their summaries: TTFT, inter-token latency, throughput."""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass, field


@dataclass
class StreamTiming:
    """One request's timeline: when its batch started and when each token arrived.

    ``arrivals`` holds one ``(time, n_tokens)`` entry per delivery (a chunk or a
    generator step), on the ``time.perf_counter`` clock.
    """

    start: float
    arrivals: list[tuple[float, int]] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    cached_tokens: int = 0
    worker_idle_share: float | None = None  # runtime only: device idle time / wall time over the batch

    def add(self, ids: list[int], at: float | None = None) -> None:
        """Record ``ids`` arriving now (or at ``at``)."""
        if not ids:
            return
        self.arrivals.append((time.perf_counter() if at is None else at, len(ids)))
        self.token_ids.extend(ids)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def ttft(self) -> float:
        """Seconds from the batch start to the first token (nan if none came)."""
        return self.arrivals[0][0] - self.start if self.arrivals else math.nan

    @property
    def end(self) -> float:
        return self.arrivals[-1][0] if self.arrivals else self.start

    def itls(self) -> list[float]:
        """Gaps between tokens; a delivery of k tokens counts its gap once and k-1 zero gaps."""
        out: list[float] = []
        for (prev, _), (now, k) in zip(self.arrivals, self.arrivals[1:]):
            out.append(now - prev)
            out.extend([0.0] * (k - 1))
        if self.arrivals and self.arrivals[0][1] > 1:
            out.extend([0.0] * (self.arrivals[0][1] - 1))
        return out


def percentile(values: list[float], q: float) -> float:
    """Linear-interpolated percentile ``q`` in [0, 100]; nan for no values."""
    if not values:
        return math.nan
    s = sorted(values)
    pos = (len(s) - 1) * q / 100.0
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summarize(streams: list[StreamTiming]) -> dict[str, float]:
    """Aggregate numbers of a group of streams that started together.

    Times are in milliseconds, throughputs in tokens per second.
    ``decode_tok_s`` is per stream after its first token, averaged over streams.
    """
    if not streams:
        return {}
    start = min(s.start for s in streams)
    end = max(s.end for s in streams)
    total = sum(s.n_tokens for s in streams)
    ttfts = [s.ttft for s in streams if s.arrivals]
    itls = [g for s in streams for g in s.itls()]
    decode_rates = []
    for s in streams:
        if s.n_tokens > 1 and s.end > s.arrivals[0][0]:
            decode_rates.append((s.n_tokens - s.arrivals[0][1]) / (s.end - s.arrivals[0][0]))
    wall = end - start
    return {
        "streams": len(streams),
        "output_tokens": total,
        "cached_tokens": sum(s.cached_tokens for s in streams),
        "wall_s": wall,
        "total_tok_s": total / wall if wall > 0 else math.nan,
        "decode_tok_s": sum(decode_rates) / len(decode_rates) if decode_rates else math.nan,
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p95_ms": 1e3 * percentile(ttfts, 95),
        "itl_p50_ms": 1e3 * percentile(itls, 50),
        "itl_p95_ms": 1e3 * percentile(itls, 95),
    }


def median_summary(runs: list[dict[str, float]]) -> dict[str, float]:
    """Per-key median over repeats of the same measurement (keys of the first run)."""
    if len(runs) == 1:
        return dict(runs[0])
    out: dict[str, float] = {}
    for key, value in runs[0].items():
        values = [r[key] for r in runs if isinstance(r.get(key), (int, float)) and not math.isnan(r[key])]
        med = percentile(values, 50) if values else value
        out[key] = int(round(med)) if isinstance(value, int) and not isinstance(value, bool) else med
    return out


def ratio(a: float, b: float) -> float:
    """``a / b``, nan when undefined."""
    if b is None or a is None or b == 0 or math.isnan(a) or math.isnan(b):
        return math.nan
    return a / b


class Progress:
    """Progress lines on stderr, stamped with seconds since the bench started."""

    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self, message: str) -> None:
        print(f"[bench {time.perf_counter() - self.t0:7.1f}s, load {load_average()}] {message}", file=sys.stderr, flush=True)


def load_average() -> str:
    """The 1-minute load average (other work on the machine skews every number), or '?'."""
    try:
        return f"{os.getloadavg()[0]:.2f}"
    except (AttributeError, OSError):
        return "?"
