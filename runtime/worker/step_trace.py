"""Where the worker's host time goes per step, in the running service (a diagnosis switch).

``RUNTIME_WORKER_TRACE=path`` wraps the engine and the scheduler socket in timing proxies once
the worker is ready (start-up compiles are not counted) and writes a per-phase summary to
``path.PID`` when the worker exits. Python's garbage-collector pauses are timed too.
"""

from __future__ import annotations

import gc
import os
import time
from collections import Counter, defaultdict

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
        # Step wall time by what the step held: from its submit (or the last step's finalize,
        # if later: steps overlap when chained) to its own finalize.
        self.steps: dict[str, list[float]] = defaultdict(list)
        # MLX's kernel cache (``kernel_cache``): files added during a slow step mean kernel builds.
        self.kernel_dir = os.environ.get("MLX_PTX_CACHE_DIR")
        self._kernel_files = _file_count(self.kernel_dir)
        gc.callbacks.append(self._on_gc)

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
        finalize = self.timed("finalize", engine.finalize)
        build, submit = self.timed("build", engine.build), engine.submit
        times = self.times["submit"]
        # step id -> (what it holds, its class for the step table, shapes before its build)
        built_at: dict[int, tuple[str, str, tuple[int, int]]] = {}
        submitted: dict[int, tuple[float, str]] = {}  # step id -> (submit start, step class)
        last_done = [0.0]

        def timed_finalize(launched):
            out = finalize(launched)
            now = time.perf_counter()
            start, kind = submitted.pop(getattr(launched, "step_id", None), (None, ""))
            if start is not None:
                self.steps[kind].append(now - max(start, last_done[0]))
            last_done[0] = now
            return out

        def traced_build(step):
            before = engine.shapes_built
            built = build(step)
            if len(built_at) > 64:
                built_at.clear()  # steps whose submit never came (a failed build)
            # decode steps that write the pools in place (a tail flush) wait for the step before them
            kind = _step_class(step) + (", in place" if not step.prefills and getattr(built, "in_place", False) else "")
            built_at[built.step_id] = (_describe(step), kind, before)
            return built

        def timed_submit(built) -> None:
            what, kind, before = built_at.pop(built.step_id, ("?", "", engine.shapes_built))
            t0 = time.perf_counter()
            if len(submitted) > 64:
                submitted.clear()  # steps whose finalize never came (a failed step)
            submitted[built.step_id] = (t0, kind)
            prepares, forwards = len(self.times["prepare"]), len(self.times["forward"])
            _reset_peak()  # (a step whose writes copy a pool layer instead of writing in place peaks above active)
            try:
                return submit(built)
            finally:
                took = time.perf_counter() - t0
                times.append(took)
                if took > SLOW_S:
                    after = engine.shapes_built
                    self.slow.append((took, time.perf_counter() - self.started,
                                      f"step {built.step_id}: {what}; new prefill shapes {after[0] - before[0]}, "
                                      f"new decode traces {after[1] - before[1]}{self._slow_detail(prepares, forwards, took)}"))
                    self.slow.sort(key=lambda s: -s[0])
                    del self.slow[SLOW_KEPT:]

        engine.build, engine.submit, engine.finalize = traced_build, timed_submit, timed_finalize
        # What decode steps did to the decode tail and a hybrid's resident states (counted from here on).
        tail = getattr(getattr(engine, "paths", None), "tail", None)
        aux = getattr(engine, "aux_pool", None)
        self._events = [(name, holder.events, Counter(holder.events)) for name, holder in
                        (("decode tail", tail), ("recurrent states", aux)) if holder is not None]
        if hasattr(engine, "prepare"):  # inside submit: a step's prefill forwards and the waits between them
            engine.prepare = self.timed("prepare", engine.prepare)
        if hasattr(engine, "_prefill_batch"):  # inside prepare: building one batched prefill forward
            engine._prefill_batch = self.timed("forward", engine._prefill_batch)

    def _slow_detail(self, prepares_before: int, forwards_before: int, took: float) -> str:
        """What a slow submit spent in ``prepare`` and in how many prefill forwards, the rest
        (``mx.async_eval``: MLX encoding and queueing the step), and the kernel files MLX wrote meanwhile."""
        forwards = len(self.times["forward"]) - forwards_before
        building = sum(self.times["forward"][forwards_before:])
        prepare = sum(self.times["prepare"][prepares_before:])
        detail = (f"; prepare {prepare * 1e3:.1f} ms, {forwards} separate prefill forwards "
                  f"(built in {building * 1e3:.1f} ms); queueing {(took - prepare) * 1e3:.1f} ms; {_memory()}")
        if self.kernel_dir:
            count = _file_count(self.kernel_dir)
            detail += f"; kernel cache files +{count - self._kernel_files} since the last slow submit"
            self._kernel_files = count
        return detail

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
        lines.append("steps by what they held (prefill tokens, decode rows): count, mean / p50 / p95 ms")
        for kind, values in sorted(self.steps.items()):
            v = np.array(values) * 1e3
            lines.append(f"  {kind:44s} {len(v):7d}  {v.mean():7.2f} {np.percentile(v, 50):7.2f} {np.percentile(v, 95):7.2f}")
        for name, events, before_events in getattr(self, "_events", []):
            counts = {event: n - before_events.get(event, 0) for event, n in sorted(events.items())}
            lines.append(f"{name}: " + ", ".join(f"{event} {n}" for event, n in counts.items() if n))
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


def _reset_peak() -> None:
    import mlx.core as mx

    mx.reset_peak_memory()


def _memory() -> str:
    """MLX's device memory now: in use by arrays, the most in use since the submit began (buffers a
    step allocates as it is encoded: a pool layer copied instead of written in place shows here),
    held in its buffer cache, and its limit (GB)."""
    import mlx.core as mx

    return (f"memory {mx.get_active_memory() / 1e9:.1f} GB active, peak {mx.get_peak_memory() / 1e9:.1f} GB in "
            f"the submit, {mx.get_cache_memory() / 1e9:.1f} GB cached, limit {mx.get_memory_limit() / 1e9:.1f} GB")


def _file_count(folder: str | None) -> int:
    """Files under ``folder`` (0 without one)."""
    if not folder:
        return 0
    return sum(len(files) for _, _, files in os.walk(folder))


def _describe(step) -> str:
    """What a step holds, in a few words: its prefill chunks and decode rows."""
    tokens, rows = _sizes(step)
    decode = step.decode
    sampled = decode is not None and bool(decode.mask_rows or decode.deferred_rows or max(decode.temperatures, default=0.0) > 0)
    return (f"{len(step.prefills)} prefill chunks ({tokens} tokens), {rows} decode rows"
            + (" (sampled or masked)" if sampled else ""))


def _bucket(n: int, edges: tuple[int, ...]) -> str:
    if n == 0:
        return "0"
    low = 1
    for edge in edges:
        if n <= edge:
            return f"{low}-{edge}"
        low = edge + 1
    return f">{edges[-1]}"


def _sizes(step) -> tuple[int, int]:
    """A step's prefill tokens and decode rows."""
    return sum(len(c.token_ids) for c in step.prefills), len(step.decode.rows) if step.decode is not None else 0


def _step_class(step) -> str:
    """A step's class for the step-time table: its prefill tokens and decode rows, bucketed."""
    tokens, rows = _sizes(step)
    return (f"prefill {_bucket(tokens, (256, 512, 1024, 2048)):>9s}, "
            f"decode {_bucket(rows, (1, 8, 16, 32, 64, 128)):>7s}")


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
