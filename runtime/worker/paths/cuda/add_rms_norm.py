"""A residual add and the RMSNorm after it as one CUDA kernel, with MLX's bits.

A pre-norm block computes ``h = x + r`` and then ``rms_norm(h)`` (the next sub-block's or the
next layer's input): two MLX kernels (``binary_vv`` Add, ``rms_norm_small``), each about 7 us
of host encoding on a one-row decode step, which is host-bound. This kernel writes both ``h``
and the normalized row. Its arithmetic is MLX 0.32's ``rms_norm_small`` on the rounded sum:
the same thread for each 16-byte vector of the row (``BLOCK`` threads, ``CHUNKS`` vectors each,
chosen as MLX's ``dispatch_num_chunks`` chooses), the squares summed with one fused
multiply-add each, the block's sum by cooperative groups' warp reduction twice, then
``rsqrt(sum / n + eps)`` and ``w * T(x * normalizer)``. Rows wider than MLX's small kernel
takes (1,024 16-byte vectors) keep MLX's two kernels. The worker checks the bits at start-up
(``check``) and keeps MLX's kernels if they differ.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.worker.paths.cuda.cubin_kernels import cuda_kernel

HEADER = "#include <cooperative_groups.h>\n#include <cooperative_groups/reduce.h>\nnamespace cg = cooperative_groups;\n"

# Template parameters: T (dtype), BLOCK (threads), CHUNKS (16-byte vectors a thread), N (the row
# width). One block per row.
SOURCE = """
    constexpr int READS = 16 / sizeof(T);
    __shared__ float partial[BLOCK / 32 > 0 ? BLOCK / 32 : 1];
    auto block = cg::this_thread_block();
    auto warp = cg::tiled_partition<32>(block);
    const size_t row = blockIdx.x;
    const int t = threadIdx.x;
    const T* xr = x + row * N;
    const T* rr = r + row * N;
    T* hr = h + row * N;
    T* outr = out + row * N;
    // 16-byte loads and stores where every row start is aligned (MLX's kernels load vectors
    // too); element by element otherwise. The arithmetic is the same either way.
    const bool vec = N % READS == 0 && ((reinterpret_cast<size_t>(xr) | reinterpret_cast<size_t>(rr) |
        reinterpret_cast<size_t>(hr) | reinterpret_cast<size_t>(outr) | reinterpret_cast<size_t>(w)) & 15) == 0;
    uint4 hraw[CHUNKS];
    uint4 wraw[CHUNKS];  // the weight and eps loaded before the reduction: off its critical path
    const float epsilon = eps[0];
    float normalizer = 0.f;
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const int base = (BLOCK * i + t) * READS;
        uint4 xraw = make_uint4(0, 0, 0, 0), rraw = make_uint4(0, 0, 0, 0);
        T* xe = reinterpret_cast<T*>(&xraw);
        T* re = reinterpret_cast<T*>(&rraw);
        if (vec && base < N) {
            xraw = *reinterpret_cast<const uint4*>(xr + base);
            rraw = *reinterpret_cast<const uint4*>(rr + base);
            wraw[i] = *reinterpret_cast<const uint4*>(w + base);
        } else if (!vec) {
#pragma unroll
            for (int j = 0; j < READS; ++j) {
                if (base + j < N) {
                    xe[j] = xr[base + j];
                    re[j] = rr[base + j];
                }
            }
        }
        T* he = reinterpret_cast<T*>(&hraw[i]);
#pragma unroll
        for (int j = 0; j < READS; ++j) {
            he[j] = base + j < N ? T(xe[j] + re[j]) : T(0);
            const float v = static_cast<float>(he[j]);
            normalizer += v * v;
        }
    }
    normalizer = cg::reduce(warp, normalizer, cg::plus<float>());
    if (BLOCK > 32) {
        if (warp.thread_rank() == 0) partial[warp.meta_group_rank()] = normalizer;
        block.sync();
        normalizer = warp.thread_rank() < warp.meta_group_size() ? partial[warp.thread_rank()] : 0.f;
        normalizer = cg::reduce(warp, normalizer, cg::plus<float>());
    }
    normalizer = rsqrt(normalizer / N + epsilon);
#pragma unroll
    for (int i = 0; i < CHUNKS; ++i) {
        const int base = (BLOCK * i + t) * READS;
        const T* he = reinterpret_cast<const T*>(&hraw[i]);
        if (vec) {
            if (base < N) {
                const T* we = reinterpret_cast<const T*>(&wraw[i]);
                uint4 oraw;
                T* oe = reinterpret_cast<T*>(&oraw);
#pragma unroll
                for (int j = 0; j < READS; ++j) oe[j] = T(we[j] * static_cast<T>(static_cast<float>(he[j]) * normalizer));
                *reinterpret_cast<uint4*>(hr + base) = hraw[i];
                *reinterpret_cast<uint4*>(outr + base) = oraw;
            }
        } else {
#pragma unroll
            for (int j = 0; j < READS; ++j) {
                if (base + j < N) {
                    hr[base + j] = he[j];
                    outr[base + j] = T(w[base + j] * static_cast<T>(static_cast<float>(he[j]) * normalizer));
                }
            }
        }
    }
"""

SMALL_VECTORS = 128 * 8  # the widest row (in 16-byte vectors) MLX's rms_norm_small takes


def launch_geometry(width: int, itemsize: int) -> tuple[int, int] | None:
    """(threads, vectors a thread) MLX's ``rms_norm_small`` uses for rows of ``width``
    elements of ``itemsize`` bytes, or None where MLX takes its wide kernel."""
    reads = 16 // itemsize
    if width > reads * SMALL_VECTORS:
        return None
    vectors = -(-width // reads)
    if width <= reads * 64:
        return 64, 1
    for block in (128, 64):
        if vectors % block == 0 and vectors // block <= 8:
            return block, vectors // block
    return 128, min(8, -(-vectors // 128))


# Rows the kernel takes at most (a decode step's); a prefill forward's thousands keep MLX's two kernels.
# The kernel pays on host-bound steps of few rows (one launch for two, session 29: a 1B one-row step
# 1.22x mlx-lm's); its time over many rows was never measured, and in session 44 the 1B's separate
# prefill forwards ran 2-5 times slower than before the kernel came (session 28's sources, one H100).
MAX_KERNEL_ROWS = 256


def reference(x: mx.array, r: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
    """The sum and its RMSNorm by MLX's own kernels (what every device computes without the kernel)."""
    h = x + r
    return h, mx.fast.rms_norm(h, weight, eps)


class AddRmsNorm:
    """``(h, rms_norm(h))`` for ``h = x + r``: the CUDA kernel where ``use_kernel`` and the row
    width and dtype allow it, else MLX's two kernels (``reference``)."""

    def __init__(self, use_kernel: bool) -> None:
        self.use_kernel = use_kernel
        self.problem: str | None = None  # why the kernel was dropped at start-up (``check``), if it was
        self._kernel = None
        self._eps: dict[float, mx.array] = {}

    def _launch(self, x: mx.array, r: mx.array, weight: mx.array) -> tuple[int, int] | None:
        """The kernel's (threads, vectors a thread) for these arrays, or None where it does not apply."""
        if not (self.use_kernel and x.dtype == r.dtype == weight.dtype and x.dtype in (mx.bfloat16, mx.float16)
                and x.shape == r.shape and weight.ndim == 1 and weight.shape[0] == x.shape[-1]
                and x.size // max(x.shape[-1], 1) <= MAX_KERNEL_ROWS):
            return None
        return launch_geometry(x.shape[-1], x.dtype.size)

    def __call__(self, x: mx.array, r: mx.array, weight: mx.array, eps: float) -> tuple[mx.array, mx.array]:
        launch = self._launch(x, r, weight)
        if launch is None:
            return reference(x, r, weight, eps)
        width = x.shape[-1]
        block, chunks = launch
        if self._kernel is None:
            self._kernel = cuda_kernel(name="runtime_add_rms_norm", input_names=["x", "r", "w", "eps"],
                                       output_names=["h", "out"], source=SOURCE, header=HEADER)
        eps_arr = self._eps.get(eps)
        if eps_arr is None:
            eps_arr = self._eps[eps] = mx.array([eps], dtype=mx.float32)
        rows = x.size // width
        h, out = self._kernel(inputs=[x, r, weight, eps_arr],
                              template=[("T", x.dtype), ("BLOCK", block), ("CHUNKS", chunks), ("N", width)],
                              grid=(rows * block, 1, 1), threadgroup=(block, 1, 1),
                              output_shapes=[x.shape, x.shape], output_dtypes=[x.dtype, x.dtype])
        return h, out

    def check(self, width: int, dtype: mx.Dtype, rows: tuple[int, ...] = (1, 3, 64)) -> str | None:
        """None where the kernel gives MLX's bits for rows of ``width``, else what differed (or
        why it does not apply); random rows with a spread of magnitudes, a random weight."""
        key = mx.random.key(7)
        for n in rows:
            k1, k2, k3, key = mx.random.split(key, 4)
            x = (mx.random.normal((n, width), key=k1) * 3).astype(dtype)
            r = mx.random.normal((n, width), key=k2).astype(dtype)
            weight = (1 + 0.1 * mx.random.normal((width,), key=k3)).astype(dtype)
            if self._launch(x, r, weight) is None:
                return f"{dtype} rows of {width} take MLX's own kernels"
            for eps in (1e-5, 1e-6):
                try:
                    got = self(x, r, weight, eps)
                    mx.eval(*got)
                except Exception as exc:  # noqa: BLE001 - a kernel that cannot build or run is not used
                    return f"the kernel failed: {str(exc)[:200]}"
                want = reference(x, r, weight, eps)
                for name, a, b in zip(("sum", "norm"), got, want):
                    if not mx.array_equal(a, b).item():
                        return f"{n} rows of {width}: the {name} differs from MLX's"
        return None
