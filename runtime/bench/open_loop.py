"""Requests sent on a schedule to an OpenAI ``/v1/completions`` endpoint, and their summary.

Open loop: each request is sent at its own arrival time (seconds after the run's start),
whether or not earlier ones have finished, so a server that falls behind builds a queue as
it would under real traffic. Every request is streamed (server-sent events) and timed on its
own: TTFT from its send time to its first text, TPOT from its first to its last token. Both
the runtime's gateway and ``mlx_lm.server`` speak this protocol, so one driver serves both.
"""

from __future__ import annotations

import asyncio
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from runtime.bench import sse_load
from runtime.bench.measure import percentile

REPLY_TIMEOUT_S = 900.0  # a queued request may see no byte for long under overload
START_DELAY_S = 0.05  # t=0 a little ahead, so the first sends are not late by the task set-up
MAX_ERRORS_KEPT = 5


@dataclass(frozen=True)
class Request:
    """One request of a schedule: when it arrives, its text and how many tokens it may generate."""

    at: float  # seconds after the run's start
    prompt: str
    max_tokens: int
    wave: str = "main"  # which part of the workload it belongs to
    logit_bias: dict[str, float] | None = None  # OpenAI's logit_bias, sent as is


@dataclass
class RequestTiming:
    """One request's timeline on the ``time.perf_counter`` clock (nan where it never got there)."""

    due: float
    send: float = math.nan
    first: float = math.nan
    last: float = math.nan
    tokens: int = 0
    cached_tokens: int | None = None
    error: str | None = None
    asked: int = 0  # max_tokens
    finish: str | None = None  # the last finish_reason the stream carried
    counted: bool = False  # whether ``tokens`` came from the stream's usage (else from its chunks)

    @property
    def ttft(self) -> float:
        return self.first - self.send

    @property
    def tpot(self) -> float | None:
        """Seconds per output token after the first; None for a single token."""
        if self.tokens < 2 or math.isnan(self.first):
            return None
        return (self.last - self.first) / (self.tokens - 1)


async def _one(url: str, req: Request, timing: RequestTiming) -> None:
    await asyncio.sleep(max(0.0, timing.due - time.perf_counter()))
    timing.send, timing.asked = time.perf_counter(), req.max_tokens
    body = {"prompt": req.prompt, "max_tokens": req.max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}
    if req.logit_bias:
        body["logit_bias"] = req.logit_bias
    chunks, ended = 0, math.nan

    def on_events(now: float, events: bytes) -> None:
        nonlocal chunks, ended
        choices, texts = sse_load.choice_and_text_events(events)
        if choices:
            ended = now
        if texts:
            if not chunks:
                timing.first = now
            timing.last, chunks = now, chunks + texts
        if (finish := sse_load.last_finish_reason(events)) is not None:
            timing.finish = finish

    try:
        usage = await sse_load.stream(url, "/v1/completions", body, on_events, REPLY_TIMEOUT_S)
    except Exception as exc:  # any failure is the request's, reported with it, never dropped
        timing.error = f"{type(exc).__name__}: {exc}"
        return
    if not chunks:  # no text at all (e.g. an EOS first): the closing chunk is the first "token"
        timing.first = timing.last = ended
    if timing.finish is None and usage is None:  # cut: a server's generation died under it
        timing.error = "the stream ended without a finish reason or usage (cut short by the server)"
        return
    counted = (usage or {}).get("completion_tokens")
    timing.tokens = int(counted) if counted is not None else chunks  # a chunk may carry several tokens
    timing.counted = counted is not None
    details = (usage or {}).get("prompt_tokens_details") or {}
    timing.cached_tokens = details.get("cached_tokens")


async def _run(url: str, requests: Sequence[Request], on_done: Callable[[int], None] | None,
               ) -> tuple[float, list[RequestTiming]]:
    # The light SSE client (runtime/bench/sse_load.py): one process reads every stream of the
    # schedule, so parsing each event with httpx would make the client the bottleneck.
    t0 = time.perf_counter() + START_DELAY_S
    timings = [RequestTiming(due=t0 + r.at) for r in requests]
    tasks = [asyncio.create_task(_one(url, r, t)) for r, t in zip(requests, timings)]
    for done, task in enumerate(asyncio.as_completed(tasks), start=1):
        await task
        if on_done is not None:
            on_done(done)
    return t0, timings


def run_schedule(url: str, requests: Sequence[Request], on_done: Callable[[int], None] | None = None,
                 ) -> tuple[float, list[RequestTiming]]:
    """Send every request at its arrival time; return the run's start and each request's timing."""
    return asyncio.run(_run(url, requests, on_done))


def summarize_open(timings: Sequence[RequestTiming], start: float, ttft_slo_s: float, tpot_slo_s: float,
                   ) -> dict:
    """The numbers of one side's run (times in ms; throughput in output tokens/s from ``start``).

    Goodput is the share of ALL requests (failed ones count against it) whose TTFT and TPOT
    are within the targets; a one-token reply has no TPOT and is judged on TTFT alone.
    """
    done = [t for t in timings if t.error is None]
    ends = [t.last for t in done if not math.isnan(t.last)]
    wall = max(ends) - start if ends else math.nan
    tokens = sum(t.tokens for t in done)
    ttfts = [t.ttft for t in done if not math.isnan(t.ttft)]
    tpots = [t.tpot for t in done if t.tpot is not None]
    good = sum(1 for t in done if t.ttft <= ttft_slo_s and (t.tpot is None or t.tpot <= tpot_slo_s))
    cached = [t.cached_tokens for t in done if t.cached_tokens is not None]
    lags = [t.send - t.due for t in timings if not math.isnan(t.send)]
    errors = [t.error for t in timings if t.error is not None]
    return {
        "requests": len(timings),
        "completed": len(done),
        "failed": len(errors),
        "errors": sorted(set(errors))[:MAX_ERRORS_KEPT],
        "output_tokens": tokens,
        "wall_s": wall,
        "throughput_tok_s": tokens / wall if wall > 0 else math.nan,
        "ttft_p50_ms": 1e3 * percentile(ttfts, 50),
        "ttft_p99_ms": 1e3 * percentile(ttfts, 99),
        "tpot_p50_ms": 1e3 * percentile(tpots, 50),
        "tpot_p99_ms": 1e3 * percentile(tpots, 99),
        "goodput": good / len(timings) if timings else math.nan,
        "cached_tokens": sum(cached) if cached else None,
        "send_lag_max_ms": 1e3 * max(lags) if lags else math.nan,
        "short_replies": short_replies(done),
    }


def cache_split(timings: Sequence[RequestTiming]) -> dict:
    """The completed requests that read cached prompt tokens (hits) and those that did not
    (misses), each with its TTFT p50 in ms: a slow shared-prefix wave is either queued (hits
    slow too) or recomputing the prefix (misses). Empty where no reply said what it read."""
    done = [t for t in timings if t.error is None and not math.isnan(t.ttft)]
    if all(t.cached_tokens is None for t in done):
        return {}  # the server does not say
    hits = [t.ttft for t in done if t.cached_tokens]
    misses = [t.ttft for t in done if not t.cached_tokens]
    return {"hits": len(hits), "misses": len(misses),
            "hit_ttft_p50_ms": 1e3 * percentile(hits, 50), "miss_ttft_p50_ms": 1e3 * percentile(misses, 50)}


def per_request(timings: Sequence[RequestTiming], waves: Sequence[str], start: float) -> list[list]:
    """One row a request for the JSON: arrival (s after ``start``), wave, TTFT ms, TPOT ms,
    cached prompt tokens, output tokens (None where it never got there)."""
    def ms(x: float | None) -> float | None:
        return None if x is None or math.isnan(x) else round(1e3 * x, 2)

    return [[round(t.due - start, 3), wave, ms(t.ttft), ms(t.tpot), t.cached_tokens, t.tokens]
            for t, wave in zip(timings, waves)]


def short_replies(done: Sequence[RequestTiming]) -> dict:
    """Completed replies with fewer tokens than they asked for, by finish reason (None: the stream
    gave none), and how many streams gave no usage (their tokens counted from text chunks)."""
    short = [t for t in done if t.tokens < t.asked]
    reasons: dict[str, int] = {}
    for t in short:
        reasons[str(t.finish)] = reasons.get(str(t.finish), 0) + 1
    return {"count": len(short), "tokens_short": sum(t.asked - t.tokens for t in short),
            "finish_reasons": reasons, "without_usage": sum(1 for t in done if not t.counted)}
