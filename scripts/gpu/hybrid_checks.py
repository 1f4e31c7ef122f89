"""On the GPU: a hybrid's start-up decisions at a bench shape, each timed.

Whether its prompts may be padded (``padding_probe``), and whether the delta-net kernel passes
its start-up check at the model's own calls (``gated_delta_check``), with the calls recorded.

    python3 scripts/gpu/hybrid_checks.py --shape qwen3-next-24l-dense
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import mlx.core as mx  # noqa: E402
from mlx_lm.utils import load_model  # noqa: E402

from runtime.bench.models import synthetic_model  # noqa: E402
from runtime.worker.model.discovery import discover  # noqa: E402
from runtime.worker.model.padding_probe import pads_recurrent_exactly  # noqa: E402
from runtime.worker.paths.cuda.gated_delta_check import kernel_for, model_calls  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shape", default="qwen3-next-24l-dense")
    parser.add_argument("--work-dir", default="/tmp/runtime-bench")
    args = parser.parse_args()
    started = time.perf_counter()
    folder = synthetic_model(args.shape, Path(args.work_dir), log=print)
    model = load_model(folder)[0]
    layout = discover(model)
    print(f"loaded {args.shape} in {time.perf_counter() - started:.1f} s", flush=True)
    clock = time.perf_counter()
    print(f"pads_recurrent_exactly: {pads_recurrent_exactly(model, layout)} ({time.perf_counter() - clock:.2f} s)")
    clock = time.perf_counter()
    calls = model_calls(model, layout)
    print(f"model_calls ({time.perf_counter() - clock:.2f} s):")
    for call in calls:
        print(f"  {call}")
    clock = time.perf_counter()
    kernel = kernel_for(model, layout, on_cuda=mx.cuda.is_available())
    print(f"kernel_for: use_kernel {kernel.use_kernel}, problem {kernel.problem} ({time.perf_counter() - clock:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
