"""Many streams from several client processes, so the bench's own client is not what is timed.

One Python process parsing tens of thousands of server-sent events a second is slower than
the service it measures (each event is an HTTP line, a JSON document and an asyncio wake-up),
and real traffic comes from many clients anyway. ``spread`` splits the streams over spawned
processes of at most ``STREAMS_PER_PROCESS`` streams each; every process starts its streams
at one shared moment on the system-wide monotonic clock (``time.perf_counter`` on Linux and
macOS), so TTFT and total throughput keep their meaning.
"""

from __future__ import annotations

import math
import multiprocessing
import time
from collections.abc import Callable, Sequence

from runtime.bench.measure import StreamTiming

STREAMS_PER_PROCESS = 16
START_MARGIN_S = 0.5  # after every process has imported its client: time to connect


def _ready(barrier) -> None:
    """Pool initializer: import both clients, then tell the parent this process is ready."""
    import runtime.bench.http_side  # noqa: F401
    import runtime.bench.runtime_side  # noqa: F401

    barrier.wait()


def _part(side: str, target: str, prompts: list[list[int]], gen_lens: list[int],
          start_at: float) -> tuple[list[StreamTiming], float, float]:
    """This process's streams: (their timings, its CPU seconds and wall seconds while they ran)."""
    if side == "http":
        from runtime.bench.http_side import http_together as together
    else:
        from runtime.bench.runtime_side import run_together as together
    # Each side builds its client first and sends at start_at: a client's set-up (the HTTP
    # one imports and builds more) is not the service's time to first token.
    cpu0 = time.process_time()
    timings = together(target, prompts, gen_lens, start_at=start_at)
    return timings, time.process_time() - cpu0, time.perf_counter() - start_at


def spread(side: str, target: str, prompts: Sequence[list[int]], gen_lens: Sequence[int],
           per_process: int = STREAMS_PER_PROCESS, on_start: Callable[[], None] | None = None,
           client_cores: list[float] | None = None) -> list[StreamTiming]:
    """Send all requests at once from ``ceil(len / per_process)`` processes; ``side`` is
    "http" (``target`` the gateway's URL) or "zmq" (``target`` the client address). One
    process's share runs in this process's own client when one is enough. ``on_start`` is
    called at the shared start (after the processes are up); ``client_cores`` gets each client
    process's CPU time over its streams' wall time (1.0: the client saturated its core)."""
    procs = math.ceil(len(prompts) / per_process)
    if procs <= 1:
        if on_start is not None:
            on_start()
        timings, cpu, wall = _part(side, target, list(prompts), list(gen_lens), time.perf_counter())
        if client_cores is not None and wall > 0:
            client_cores.append(cpu / wall)
        return timings
    bounds = [len(prompts) * i // procs for i in range(procs + 1)]
    parts = [(list(prompts[a:b]), list(gen_lens[a:b])) for a, b in zip(bounds, bounds[1:])]
    context = multiprocessing.get_context("spawn")
    barrier = context.Barrier(procs + 1)
    with context.Pool(procs, initializer=_ready, initargs=(barrier,)) as pool:
        barrier.wait(timeout=120)
        start_at = time.perf_counter() + START_MARGIN_S
        pending = [pool.apply_async(_part, (side, target, p, g, start_at)) for p, g in parts]
        if on_start is not None:
            time.sleep(max(0.0, start_at - time.perf_counter()))
            on_start()
        out: list[StreamTiming] = []
        for job in pending:
            timings, cpu, wall = job.get()
            out.extend(timings)
            if client_cores is not None and wall > 0:
                client_cores.append(cpu / wall)
        return out
