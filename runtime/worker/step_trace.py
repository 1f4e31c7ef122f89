"""Where the worker's host time goes per step, in the running service (a diagnosis switch).

``RUNTIME_WORKER_TRACE=path`` wraps the engine and the scheduler socket in timing proxies once
the worker is ready (start-up compiles are not counted) and writes a per-phase summary to
``path.PID`` when the worker exits. Python's garbage-collector pauses are timed too.
"""

from __future__ import annotations

import gc
import os
import signal
import sys
import time
from collections import defaultdict

import numpy as np


class StepTrace:
    """Durations per phase (build, submit, finalize, send, recv, gc) since the worker was ready."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.started = time.perf_counter()
        self.times: dict[str, list[float]] = defaultdict(list)
        self._gc_since = 0.0
        self._threads = _thread_cpu()
        gc.callbacks.append(self._on_gc)
        # A service stopped by a signal to its process group still writes the summary.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))

    def _on_gc(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._gc_since = time.perf_counter()
        else:
            self.times[f"gc gen{info.get('generation', '?')}"].append(time.perf_counter() - self._gc_since)

    def timed(self, name: str, fn):
        """``fn`` with its call durations recorded under ``name``."""
        times = self.times[name]

        def call(*args, **kwargs):
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                times.append(time.perf_counter() - t0)

        return call

    def wrap_engine(self, engine) -> None:
        for name in ("build", "submit", "finalize"):
            setattr(engine, name, self.timed(name, getattr(engine, name)))

    def summary(self) -> str:
        wall = time.perf_counter() - self.started
        lines = [f"wall {wall:.3f} s since ready; per phase: calls, total s, share of wall, mean / p50 / p95 / max us"]
        for name, values in sorted(self.times.items()):
            if not values:
                continue
            v = np.array(values) * 1e6
            lines.append(
                f"{name:10s} {len(v):7d} {v.sum() / 1e6:8.3f} {v.sum() / 1e6 / wall:6.1%}"
                f"  {v.mean():8.1f} {np.percentile(v, 50):8.1f} {np.percentile(v, 95):8.1f} {v.max():9.1f}"
            )
        before, now = self._threads, _thread_cpu()
        used = sorted(((now[t] - before.get(t, 0.0), t) for t in now), reverse=True)
        lines.append(f"gc: {gc.get_freeze_count()} objects frozen at start-up")
        lines.append(f"threads {len(now)}; busiest (CPU s since ready): "
                     + ", ".join(f"{name} {cpu:.3f}" for cpu, name in used[:6]))
        return "\n".join(lines) + "\n"

    def write(self) -> None:
        gc.callbacks.remove(self._on_gc)
        with open(self.path, "w") as f:
            f.write(self.summary())


def _thread_cpu() -> dict[str, float]:
    """CPU seconds per thread of this process (Linux /proc; empty elsewhere)."""
    out: dict[str, float] = {}
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return out
    tick = os.sysconf("SC_CLK_TCK")
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/stat") as f:
                head, _, rest = f.read().rpartition(")")
        except OSError:
            continue
        fields = rest.split()
        name = head.partition("(")[2]
        out[f"{tid}:{name}"] = (int(fields[11]) + int(fields[12])) / tick
    return out
