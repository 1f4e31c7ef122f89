"""A one-row matrix-vector product for CUDA with the bits of MLX's own ``gemv`` (sm_80+).

MLX's CUDA ``gemv_single`` gives each output row one warp; every lane loads 4 elements (8
bytes) of the row and of the input, adds their products to one float sum, moves 128 columns
on and loads again, then the warp's 32 sums are reduced. Each lane so keeps a single 8-byte
load in flight, and a decode step's weights stream at about 3 TB/s of the H200's 4.8 (5.2 ms
of an 8B step at 32k). This kernel issues ``AHEAD`` passes' loads before it adds any of them,
and adds the products in MLX's order (lane by lane: pass by pass, element by element, one
fused multiply-add each; then the warp's reduction), so every output has MLX's bits: which
reduction order that is, and that the result agrees, is checked on the device before the
kernel is used (``scripts/gemv_ab.py`` measures it).
"""

from __future__ import annotations

import mlx.core as mx

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
