"""What a new prefill shape costs on this device: first run against a repeat, per dimension.

A prefill forward's shape is (rows, padded length, start): ``start`` (the cached prefix or the
row's earlier chunks) sets the attention's key length. On a GPU each new shape may build
kernels (attention graphs, matmul plans); this times one forward the first time a shape is
seen and again when it recurs, varying one dimension at a time, so the mixed workload's
latency can be traced to the dimension that costs. ``python3 scripts/prefill_shape_cost.py
--shape llama-1b``.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, "tests")
from harness import InProcessService  # noqa: E402

from runtime.bench.models import synthetic_model  # noqa: E402
from runtime.protocol.worker import PrefillChunk, Step  # noqa: E402
from runtime.worker.decode_warmup import warm_decode  # noqa: E402


class Timer:
    """Runs prefill steps on fresh slots and rows and times each one to completion."""

    def __init__(self, svc: InProcessService, slots: int) -> None:
        self.engine = svc.engine
        self.next_slot = 1
        self.slots = slots
        self.step = 0

    def _take(self, n: int) -> list[int]:
        if self.next_slot + n >= self.slots:
            self.next_slot = 1  # reuse: the contents do not matter for timing
        out = list(range(self.next_slot, self.next_slot + n))
        self.next_slot += n
        return out

    def run(self, rows: int, n: int, start: int) -> float:
        chunks = [PrefillChunk(row=r, start=start, token_ids=[5] * n, slot_ids=self._take(n),
                               prefix_slots=self._take(start) if start else []) for r in range(rows)]
        self.step += 1
        t0 = time.perf_counter()
        self.engine.finalize(self.engine.launch(Step(step_id=self.step, prefills=chunks, decode=None)))
        mx.synchronize()
        return (time.perf_counter() - t0) * 1e3


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="llama-1b")
    args = ap.parse_args()
    folder = synthetic_model(args.shape, Path(tempfile.gettempdir()) / "runtime-bench")
    slots = 65536
    svc = InProcessService(folder, kv_slots=slots, max_running=16, max_context=8192, max_step_tokens=2048,
                           prefill_chunk=512)
    warm_decode(svc.engine)
    timer = Timer(svc, slots)
    print(f"device {mx.default_device()}, {args.shape}; ms: first run / repeat", flush=True)
    for label, shapes in [
        ("length (start 0, 1 row)", [(1, n, 0) for n in (100, 203, 317, 401, 509, 612, 777, 1000, 1500, 2000)]),
        ("start (length 256, 1 row)", [(1, 256, s) for s in (64, 300, 555, 901, 1234, 2001, 3003)]),
        ("start (length 16, 1 row)", [(1, 16, s) for s in (70, 333, 701, 1111, 2222)]),
        ("rows (length 256, start 0)", [(r, 256, 0) for r in (2, 3, 4, 5, 6, 7, 8)]),
    ]:
        cells = []
        for rows, n, start in shapes:
            first = timer.run(rows, n, start)
            again = timer.run(rows, n, start)
            cells.append(f"{(rows, n, start)} {first:.1f}/{again:.1f}")
        print(f"{label}: " + "; ".join(cells), flush=True)
    print(f"engine shapes seen: {len(svc.engine.prefill_shapes)}", flush=True)


if __name__ == "__main__":
    main()
