"""Drive a running gateway over HTTP (``/v1/completions``, streamed) and time every token.

The HTTP counterpart of ``runtime_side``: token-id prompts, greedy, ``ignore_eos``, read by the
bench's light SSE client (``sse_load``); a token's arrival is the network read that brought
its event. ``wait_http`` waits for a gateway's ``/health``.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from runtime.bench import runtime_side, sse_load
from runtime.bench.measure import StreamTiming


async def _http_one(url: str, prompt: list[int], gen_len: int, timing: StreamTiming) -> None:
    body = {"prompt": prompt, "max_tokens": gen_len, "temperature": 0, "ignore_eos": True, "stream": True,
            "stream_options": {"include_usage": True}}
    usage = await sse_load.stream(url, "/v1/completions", body,
                                  lambda now, events: timing.add([0] * sse_load.choice_events(events), at=now))
    total = int(usage["completion_tokens"]) if usage else 0
    if total > timing.n_tokens and timing.arrivals:  # chunks that carried several tokens
        timing.add([0] * (total - timing.n_tokens), at=timing.arrivals[-1][0])


async def _http_together(url: str, prompts: Sequence[list[int]], gen_lens: Sequence[int],
                         start_at: float | None) -> list[StreamTiming]:
    start = await runtime_side.wait_for_start(start_at)
    timings = [StreamTiming(start=start) for _ in prompts]
    await asyncio.gather(*(_http_one(url, p, g, t) for p, g, t in zip(prompts, gen_lens, timings)))
    return timings


def http_together(url: str, prompts: Sequence[list[int]], gen_lens: Sequence[int],
                  start_at: float | None = None) -> list[StreamTiming]:
    """Send all requests at once over HTTP (one connection each); the shared start is t=0
    (``start_at``, as in ``runtime_side.run_together``)."""
    return asyncio.run(_http_together(url, prompts, gen_lens, start_at))


def wait_http(url: str, service: Any = None, timeout_s: float = 900.0) -> None:
    """Until the gateway's /health says 200 (503 while the worker warms up: minutes on a GPU
    whose kernel cache is cold). With ``service`` (a started ``Service``), its exit ends the
    wait at once, with its output in the error."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if service is not None and service.proc is not None and service.proc.poll() is not None:
            raise RuntimeError(f"the service exited before its gateway at {url} answered:\n{service.log()}")
        if time.monotonic() > deadline:
            tail = f":\n{service.log()}" if service is not None else ""
            raise RuntimeError(f"the gateway at {url} did not answer /health within {timeout_s} s{tail}")
        time.sleep(0.2)
