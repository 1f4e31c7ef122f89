"""One-row products: MLX's ``gemv`` against a kernel of the same bits with more loads in flight (CUDA only).

MLX's CUDA ``gemv_single`` gives each output row one warp; every lane loads 4 elements (8
bytes) of the row and of the input, adds their products to one float sum, moves 128 columns
on and loads again, then the warp's 32 sums are reduced. The kernel here issues ``AHEAD``
passes' loads before it adds any of them and adds the products in MLX's order, so its outputs
can have MLX's bits. For each weight shape of the Llama 1B / 8B decode step (the stacked
q/k/v and gate/up, o, down, the output head), one bf16 input row: whether each reduction
order gives MLX's bits, and GPU time per call (CUPTI) of MLX's kernel and this one.

Session 23 on an H200 (docs/BENCHMARKS.md): the same bits (every order but ``xor_up``), and no
faster: MLX's own kernel already streams 3.9-4.5 TB/s at these shapes, so the runtime keeps it.

    python3 scripts/gemv_ab.py --ahead 4,8,16
"""

from __future__ import annotations

import argparse

import mlx.core as mx
from kernel_bench import per_call

ROWS_PER_BLOCK = 8  # warps per block, one output row each (as MLX's)
PER_LANE = 4  # elements a lane loads a pass (as MLX's at input widths of 128s)

# The warp's reduction of its 32 lane sums, by name: the order decides the bits.
REDUCTIONS = {
    "cg": "    sum = cg::reduce(cg::tiled_partition<32>(cg::this_thread_block()), sum, cg::plus<float>());\n",
    "xor_down": "#pragma unroll\n    for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);\n",
    "xor_up": "#pragma unroll\n    for (int off = 1; off < 32; off <<= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);\n",
    "down": "#pragma unroll\n    for (int off = 16; off > 0; off >>= 1) sum += __shfl_down_sync(0xffffffff, sum, off);\n",
}

HEADER = "#include <cooperative_groups.h>\n#include <cooperative_groups/reduce.h>\nnamespace cg = cooperative_groups;\n"


def source(reduction: str, fused: bool = True) -> str:
    """The kernel body: template ``T`` (dtype), ``N`` (output rows), ``K`` (input width, a
    multiple of 128), ``AHEAD`` (passes loaded before any is added). ``fused``: each product
    added by one fused multiply-add (else rounded, then added)."""
    add = ("sum = fmaf(static_cast<float>(a[j]), static_cast<float>(b[j]), sum)" if fused else
           "sum = __fadd_rn(sum, __fmul_rn(static_cast<float>(a[j]), static_cast<float>(b[j])))")
    return f"""
    constexpr int STRIDE = 32 * {PER_LANE};
    constexpr int PASSES = K / STRIDE;
    const int lane = threadIdx.x % 32;
    const int row = blockIdx.x * {ROWS_PER_BLOCK} + threadIdx.x / 32;
    if (row >= N) return;  // the whole warp: one row each
    const T* w = weight + (size_t)row * K + {PER_LANE} * lane;
    const T* x = vec + {PER_LANE} * lane;
    float sum = 0.f;
    for (int p0 = 0; p0 < PASSES; p0 += AHEAD) {{
        uint2 wv[AHEAD];
        uint2 xv[AHEAD];
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {{
            if (p0 + u < PASSES) {{
                wv[u] = *reinterpret_cast<const uint2*>(w + (size_t)(p0 + u) * STRIDE);
                xv[u] = *reinterpret_cast<const uint2*>(x + (p0 + u) * STRIDE);
            }}
        }}
#pragma unroll
        for (int u = 0; u < AHEAD; ++u) {{
            if (p0 + u < PASSES) {{
                const T* a = reinterpret_cast<const T*>(&wv[u]);
                const T* b = reinterpret_cast<const T*>(&xv[u]);
#pragma unroll
                for (int j = 0; j < {PER_LANE}; ++j) {add};
            }}
        }}
    }}
{REDUCTIONS[reduction]}    if (lane == 0) out[row] = static_cast<T>(sum);
"""


class OneRowProduct:
    """``x @ weight.T`` for one input row (``x``: (..., K) with one row in all; ``weight``:
    (N, K), both bf16 or fp16, K a multiple of 128) through this module's kernel."""

    def __init__(self, reduction: str, ahead: int = 8, fused: bool = True) -> None:
        self.reduction = reduction
        self.ahead = ahead
        self._kernel = mx.fast.cuda_kernel(
            name=f"runtime_gemv_{reduction}{'' if fused else '_unfused'}", input_names=["weight", "vec"],
            output_names=["out"], source=source(reduction, fused), header=HEADER if reduction == "cg" else "")

    @staticmethod
    def supports(x: mx.array, weight: mx.array) -> bool:
        """Whether the kernel computes this product: one row, a 2-byte float dtype, K of 128s."""
        return (x.size == x.shape[-1] and x.dtype == weight.dtype and weight.dtype in (mx.bfloat16, mx.float16)
                and weight.ndim == 2 and weight.shape[1] == x.shape[-1] and weight.shape[1] % (32 * PER_LANE) == 0)

    def __call__(self, x: mx.array, weight: mx.array) -> mx.array:
        n, k = weight.shape
        blocks = -(-n // ROWS_PER_BLOCK)
        (out,) = self._kernel(
            inputs=[weight, x.reshape(k)],
            template=[("T", weight.dtype), ("N", n), ("K", k), ("AHEAD", self.ahead)],
            grid=(blocks * ROWS_PER_BLOCK * 32, 1, 1), threadgroup=(ROWS_PER_BLOCK * 32, 1, 1),
            output_shapes=[(n,)], output_dtypes=[weight.dtype])
        return out.reshape(*x.shape[:-1], n)

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
