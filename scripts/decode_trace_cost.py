"""What one compiled decode trace costs on this device, split into its parts.

Whether a decode shape met in the middle of serving can afford a new trace. This times, for
a few row counts: the trace itself (the compiled function's first call, nothing evaluated),
its first evaluation (kernel builds: the first row count builds them all, later ones only
new paged-kernel launch shapes, which the service builds at start-up), a replay, and the same
step eager; and profiles one trace to show where its host time goes. H200, 1B: trace 5-6 ms,
first evaluation 32 ms where the kernels exist.
``python3 scripts/decode_trace_cost.py --shape llama-1b``.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, "tests")
from harness import InProcessService  # noqa: E402

from runtime.bench.models import synthetic_model  # noqa: E402


def _ms(t0: float) -> float:
    return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--rows", default="1,8,16,64")
    ap.add_argument("--length", type=int, default=512, help="attended positions (picks the kernel launch shape)")
    args = ap.parse_args()
    folder = synthetic_model(args.shape, Path(tempfile.gettempdir()) / "runtime-bench")
    svc = InProcessService(folder, kv_slots=65536, max_running=64, max_context=4096)
    engine = svc.engine
    paged = engine.compiled_paged
    print(f"device {mx.default_device()}, compiled paged path: {paged is not None}, "
          f"row path: {engine.compiled is not None}", flush=True)
    for rows in [int(r) for r in args.rows.split(",")]:
        zeros = mx.zeros((rows,), dtype=mx.int32)
        if paged is not None:
            table = engine.paths.device_table
            launch = engine.paths.launch(rows, args.length)
            call_args = (zeros, zeros, zeros + args.length, table, zeros, engine.pool.keys, engine.pool.values,
                         [], [], launch)

            def call(key, fn=paged.traces, a=call_args):
                return fn(key, *a)

            def eager(a=call_args):
                return paged._forward(*a)
        elif engine.compiled is not None:
            c = engine.compiled
            length = c.bucket(args.length)
            index = mx.arange(rows, dtype=mx.int32)
            call_args = (zeros, index, index, c.row_cache.keys, c.row_cache.values, True, length, None, None)

            def call(key, fn=c.traces, a=call_args):
                return fn(key, *a)

            def eager(a=call_args, c=c):
                return c.traces.fn(*a)
        else:
            print("no compiled decode path on this device")
            return
        key = ("diag", rows, time.perf_counter())
        t0 = time.perf_counter()
        out = call(key)
        trace_ms = _ms(t0)
        t0 = time.perf_counter()
        mx.eval(out)
        first_ms = _ms(t0)
        replays = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(call(key))
            replays.append(_ms(t0))
        eagers = []
        for _ in range(5):
            t0 = time.perf_counter()
            mx.eval(eager())
            eagers.append(_ms(t0))
        print(f"rows {rows:3d}: trace {trace_ms:8.1f} ms, first eval {first_ms:8.1f} ms, "
              f"replay {sorted(replays)[2]:6.2f} ms, eager {sorted(eagers)[2]:6.2f} ms (medians of 5)", flush=True)
    prof = cProfile.Profile()
    key = ("diag-profile", time.perf_counter())
    prof.enable()
    out = call(key)
    prof.disable()
    mx.eval(out)
    buf = io.StringIO()
    pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(12)
    print("one trace, by own time:\n" + "\n".join(buf.getvalue().splitlines()[:30]))


if __name__ == "__main__":
    main()
