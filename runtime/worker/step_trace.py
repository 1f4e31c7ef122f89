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

SLOW_S = 0.1  # a submit this long is described in the summary
SLOW_KEPT = 12


class StepTrace:
    """Durations per phase (build, submit, finalize, send, recv, gc) since the worker was ready."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.started = time.perf_counter()
        self.times: dict[str, list[float]] = defaultdict(list)
        self._gc_since = 0.0
        self._threads = _thread_cpu()
        self.slow: list[tuple[float, float, str]] = []  # (seconds, at, what) of the slowest submits
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
        for name in ("build", "finalize"):
            setattr(engine, name, self.timed(name, getattr(engine, name)))
        submit, times = engine.submit, self.times["submit"]

        def timed_submit(built) -> None:
            before = engine.shapes_built
            t0 = time.perf_counter()
            try:
                return submit(built)
            finally:
                took = time.perf_counter() - t0
                times.append(took)
                if took > SLOW_S:
                    self._note_slow(took, built, before, engine.shapes_built)

        engine.submit = timed_submit

    def _note_slow(self, took: float, built, before: tuple[int, int], after: tuple[int, int]) -> None:
        """One slow submit, described: what the step held and what it had to build."""
        step = built.step
        prefill_tokens = sum(len(c.token_ids) for c in step.prefills) if step is not None else 0
        rows = len(step.decode.rows) if step is not None and step.decode is not None else 0
        sampled = bool(step is not None and step.decode is not None and (step.decode.mask_rows or step.decode.deferred_rows
                                                                          or max(step.decode.temperatures) > 0))
        self.slow.append((took, time.perf_counter() - self.started, (
            f"step {built.step_id}: {len(step.prefills) if step else 0} prefill chunks ({prefill_tokens} tokens), "
            f"{rows} decode rows{' (sampled or masked)' if sampled else ''}; new prefill shapes "
            f"{after[0] - before[0]}, new decode traces {after[1] - before[1]}")))
        self.slow.sort(key=lambda s: -s[0])
        del self.slow[SLOW_KEPT:]

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
        for took, at, what in self.slow:
            lines.append(f"slow submit {took * 1e3:8.1f} ms at {at:7.1f} s: {what}")
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
