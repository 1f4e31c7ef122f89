"""One-row products: MLX's ``gemv`` against ``runtime/worker/paths/cuda/gemv.py`` (CUDA only).

For each weight shape of the Llama 1B / 8B decode step (the stacked q/k/v and gate/up, o,
down, the output head), one bf16 input row: whether each reduction order of the kernel gives
MLX's bits, and GPU time per call (CUPTI) of MLX's kernel and ours at each ``--ahead``.

    python3 scripts/gemv_ab.py --ahead 4,8,16
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from kernel_bench import per_call

from runtime.worker.paths.cuda.gemv import REDUCTIONS, OneRowProduct

SHAPES = {  # (output rows, input width)
    "8b qkv": (6144, 4096), "8b o": (4096, 4096), "8b gate/up": (28672, 4096), "8b down": (4096, 14336),
    "8b head": (128256, 4096), "1b qkv": (3072, 2048), "1b gate/up": (16384, 2048), "1b down": (2048, 8192),
    "1b head": (128256, 2048),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--ahead", default="4,8,16")
    p.add_argument("--calls", type=int, default=30)
    p.add_argument("--reductions", default=",".join(REDUCTIONS))
    args = p.parse_args()
    aheads = [int(a) for a in args.ahead.split(",")]
    products = {}
    for reduction in args.reductions.split(","):
        for fused in (True, False):
            name = reduction if fused else f"{reduction}/unfused"
            for ahead in aheads:
                products[(name, ahead)] = OneRowProduct(reduction, ahead, fused)
    total = {"mlx": 0.0}
    for label, (n, k) in SHAPES.items():
        w = (mx.random.normal((n, k)) * k**-0.5).astype(mx.bfloat16)
        x = mx.random.normal((1, 1, k)).astype(mx.bfloat16)
        mx.eval(w, x)
        ref = x @ w.T
        mx.eval(ref)
        same = {}
        for (reduction, ahead), product in products.items():
            if ahead != aheads[0]:
                continue
            try:
                same[reduction] = bool(mx.array_equal(product(x, w), ref))
            except Exception as exc:  # a reduction whose headers NVRTC cannot find
                same[reduction] = f"failed: {str(exc)[:200]}"
        gbytes = n * k * 2 / 1e9
        mlx_us = sum(per_call(lambda: x @ w.T, args.calls).values())
        total["mlx"] += mlx_us
        cells = [f"mlx {mlx_us:7.1f} us ({gbytes / mlx_us * 1e3:.2f} TB/s)"]
        exact = [r for r, ok in same.items() if ok is True]
        for (reduction, ahead), product in products.items():
            if reduction != (exact[0] if exact else "xor_down"):
                continue
            us = sum(per_call(lambda: product(x, w), args.calls).values())
            total[f"ahead {ahead}"] = total.get(f"ahead {ahead}", 0.0) + us
            cells.append(f"ahead {ahead} {us:7.1f} ({gbytes / us * 1e3:.2f} TB/s)")
        print(f"{label:11s} {n:6d} x {k:5d}: " + "  ".join(cells) + f"  | same bits as mlx: {same}", flush=True)
    print("summed over the shapes, us: " + "  ".join(f"{k} {v:.1f}" for k, v in total.items()), flush=True)


if __name__ == "__main__":
    main()
