"""Drive a running service through the async client and time every streamed token."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Sequence

from runtime.bench.measure import StreamTiming
from runtime.client import Client, SyncClient
from runtime.protocol.client import StatusReply

REPLY_TIMEOUT_S = 600.0


async def _stream_one(
    client: Client, prompt: list[int], gen_len: int, timing: StreamTiming, params: dict | None = None
) -> None:
    """One streaming request, ignoring EOS (greedy unless ``params`` say otherwise); chunks are stamped as they arrive."""
    stream = client.stream(token_ids=prompt, max_tokens=gen_len, ignore_eos=True, **(params or {}))
    async for chunk in stream:
        timing.add(chunk.token_ids)
    assert stream.result is not None
    timing.cached_tokens = stream.result.cached_tokens
    if not timing.token_ids and stream.result.token_ids:
        timing.add(list(stream.result.token_ids))


async def _together(
    address: str, prompts: Sequence[list[int]], gen_lens: Sequence[int], params: dict | Sequence[dict] | None = None,
    start_at: float | None = None,
) -> list[StreamTiming]:
    async with Client(address, timeout_s=REPLY_TIMEOUT_S) as client:
        before = await client.status()
        start = await wait_for_start(start_at)
        timings = [StreamTiming(start=start) for _ in prompts]
        each = params if isinstance(params, (list, tuple)) else [params] * len(prompts)
        await asyncio.gather(*(_stream_one(client, p, g, t, q) for p, g, t, q in zip(prompts, gen_lens, timings, each)))
        after = await client.status()
    share = idle_share(before, after)
    if share is not None:
        for timing in timings:
            timing.worker_idle_share = share
    return timings


def idle_share(before: StatusReply, after: StatusReply) -> float | None:
    """The worker's own clock between two status replies: the share of its uptime with no step
    launched on the device (None when no time passed)."""
    span = after.worker_uptime_s - before.worker_uptime_s
    return (after.worker_idle_s - before.worker_idle_s) / span if span > 0 else None


def status(address: str, timeout_s: float = 30.0) -> StatusReply:
    """The service's status reply, from a connection of its own."""
    with SyncClient(address) as client:
        return client.status(timeout=timeout_s)


def run_together(
    address: str, prompts: Sequence[list[int]], gen_lens: Sequence[int], params: dict | Sequence[dict] | None = None,
    start_at: float | None = None,
) -> list[StreamTiming]:
    """Send all requests at once (one client, concurrent streams); the shared start is t=0 for TTFT.
    ``params``: extra generate keywords for every request, or a list of them, one per request.
    ``start_at`` (``time.perf_counter``): connect first, then send at that moment, which is t=0."""
    return asyncio.run(_together(address, prompts, gen_lens, params, start_at))


async def wait_for_start(start_at: float | None) -> float:
    """Wait until ``start_at`` (if given, and not past) and return the start time (t=0)."""
    if start_at is None:
        return time.perf_counter()
    await asyncio.sleep(max(0.0, start_at - time.perf_counter()))
    return start_at


async def _pooled(
    address: str,
    prompts: Sequence[list[int]],
    gen_lens: Sequence[int],
    concurrency: int,
    on_done: Callable[[int], None] | None,
) -> list[StreamTiming]:
    timings: list[StreamTiming | None] = [None] * len(prompts)
    next_index = 0
    done = 0

    async def worker(client: Client) -> None:
        nonlocal next_index, done
        while next_index < len(prompts):
            i = next_index
            next_index += 1
            timing = StreamTiming(start=time.perf_counter())
            await _stream_one(client, prompts[i], gen_lens[i], timing)
            timings[i] = timing
            done += 1
            if on_done is not None:
                on_done(done)

    async with Client(address, timeout_s=REPLY_TIMEOUT_S) as client:
        await asyncio.gather(*(worker(client) for _ in range(concurrency)))
    return [t for t in timings if t is not None]


def run_pooled(
    address: str,
    prompts: Sequence[list[int]],
    gen_lens: Sequence[int],
    concurrency: int,
    on_done: Callable[[int], None] | None = None,
) -> list[StreamTiming]:
    """Keep ``concurrency`` requests in flight until all are done; ``on_done(n)`` after each.

    Each timing starts when its own request is sent.
    """
    return asyncio.run(_pooled(address, prompts, gen_lens, concurrency, on_done))
