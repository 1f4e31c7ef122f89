"""Decode attention that reads K/V straight from the pool through a slot table.

On a CUDA device this is one custom kernel per layer: no gathered copy of K/V, no mask
array (MLX's fused decode kernel refuses array masks, so a masked batch would fall back
to unfused matmul + softmax), and far fewer kernels to launch per step. Elsewhere it is
the gather + masked ``mx.fast.scaled_dot_product_attention`` the worker always used.
"""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx

from runtime.worker.kv_pool import KVPool

UNROLL = 1  # positions per lane group and warp pass: more costs registers, hence occupancy (1 measured best)
MAX_WARPS = 4  # 128 threads a block: small blocks keep more of them resident (4 measured best on an H200)
SHARED_BYTES = 40 * 1024  # the per-warp partial results live in static shared memory (48 KiB max)
TARGET_BLOCKS = 264  # about two blocks per SM on an H100/H200 (132 SMs)
MIN_SPLIT = 32  # positions per split, at least
MAX_SPLITS = 32


def lanes_per_position(head_dim: int) -> int:
    """Lanes that share one position's K/V row in the kernel: a power of two dividing 32
    and ``head_dim``, as many as keep at least 8 elements (16 bytes of bf16) per lane."""
    lanes = 32
    while lanes > 1 and (head_dim % lanes or head_dim // lanes < 8):
        lanes //= 2
    return lanes


def warps_for(n_rep: int, head_dim: int, positions: int | None = None) -> int:
    """Warps per block: ``MAX_WARPS``, no more than the block's ``positions`` keep busy, and
    few enough for the shared-memory partials."""
    warps = MAX_WARPS
    per_pass = 32 // lanes_per_position(head_dim) * UNROLL  # positions one warp pass covers
    if positions is not None:
        while warps > 1 and (warps // 2) * per_pass >= positions:
            warps //= 2
    while warps > 1 and warps * n_rep * head_dim * 4 > SHARED_BYTES:
        warps //= 2
    return warps


def splits_for(blocks: int, max_length: int) -> int:
    """Splits of each row's positions over separate blocks (flash-decoding): a batch of few
    rows and KV heads is too few blocks to keep the GPU's memory system busy on its own."""
    splits = 1
    while splits < MAX_SPLITS and blocks * splits < TARGET_BLOCKS and max_length >= 2 * splits * MIN_SPLIT:
        splits *= 2
    return splits


def launch_shape(rows: int, n_kv: int, n_rep: int, head_dim: int, max_length: int) -> tuple[int, int]:
    """(splits, warps) for a decode batch of ``rows`` whose longest row attends to at most
    ``max_length`` positions (0: unknown, no split); one per step, shared by every layer."""
    blocks = rows * n_kv
    splits = splits_for(blocks, max_length)
    per_block = -(-max_length // splits) if max_length else None
    return splits, warps_for(n_rep, head_dim, per_block)


# One block per (row, KV head, split). A warp works on 32 / GL positions at once: each
# group of GL lanes holds one position's K/V row (PER = D / GL elements per lane, loaded as
# 16-byte vectors where aligned), so a dot product needs log2(GL) shuffles, not five. Every
# group keeps an online softmax per query head of the GQA group in float32; the groups of a
# warp are merged by shuffles, then the block's warps through shared memory.
_HEADER = """
template <typename T, int N>
__device__ inline void load_row(const T* p, float* out) {
    constexpr int V = 16 / sizeof(T);
    if (N % V == 0 && (reinterpret_cast<size_t>(p) & 15) == 0) {
#pragma unroll
        for (int j = 0; j < N / V; ++j) {
            const uint4 raw = reinterpret_cast<const uint4*>(p)[j];
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int k = 0; k < V; ++k) out[j * V + k] = static_cast<float>(e[k]);
        }
        return;
    }
#pragma unroll
    for (int i = 0; i < N; ++i) out[i] = static_cast<float>(p[i]);
}
"""

_BODY = """
    constexpr int PER = D / GL;
    constexpr int GROUPS = 32 / GL;
    const int bh = blockIdx.x / SPLITS;
    const int split = blockIdx.x % SPLITS;
    const int b = bh / HKV;
    const int h = bh % HKV;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int group = lane / GL;
    const int gl = lane % GL;
    const int tcap = table_shape[1];
    const int R = tail_keys_shape[2];
    const int n = lengths[b] - R;  // positions in the pool; the last R are in the tail
    const int total = n + R;
    const int chunk = (total + SPLITS - 1) / SPLITS;
    const int tbegin = split * chunk;
    const int tend = min(total, tbegin + chunk);
    const float sc = scale[0];
    float qr[NREP][PER];
    float acc[NREP][PER];
    float m[NREP];
    float l[NREP];
#pragma unroll
    for (int r = 0; r < NREP; ++r) {
        const size_t qbase = ((size_t)bh * NREP + r) * D + gl * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            qr[r][i] = static_cast<float>(queries[qbase + i]) * sc;
            acc[r][i] = 0.f;
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int* trow = table + (size_t)rows[b] * tcap;
    // A warp pass covers GROUPS * UNROLL consecutive positions; all its loads are issued
    // before any is used, so a warp waits for memory once per pass.
    for (int t0 = tbegin + warp * GROUPS * UNROLL; t0 < tend; t0 += NWARPS * GROUPS * UNROLL) {
        float kr[UNROLL][PER];
        float vr[UNROLL][PER];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t0 + u * GROUPS + group;
            if (t >= tend) {
#pragma unroll
                for (int i = 0; i < PER; ++i) kr[u][i] = vr[u][i] = 0.f;
            } else if (t < n) {
                const size_t base = ((size_t)trow[t] * HKV + h) * D + gl * PER;
                load_row<T, PER>(keys + base, kr[u]);
                load_row<T, PER>(values + base, vr[u]);
            } else {
                const size_t base = ((size_t)bh * R + (t - n)) * D + gl * PER;
                load_row<T, PER>(tail_keys + base, kr[u]);
                load_row<T, PER>(tail_values + base, vr[u]);
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (t0 + u * GROUPS >= tend) break;  // uniform across the warp
            const bool live = t0 + u * GROUPS + group < tend;
#pragma unroll
            for (int r = 0; r < NREP; ++r) {
                float s = 0.f;
#pragma unroll
                for (int i = 0; i < PER; ++i) s += qr[r][i] * kr[u][i];
#pragma unroll
                for (int off = GL / 2; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
                if (live) {
                    const float mn = fmaxf(m[r], s);
                    const float corr = expf(m[r] - mn);
                    const float p = expf(s - mn);
                    l[r] = l[r] * corr + p;
#pragma unroll
                    for (int i = 0; i < PER; ++i) acc[r][i] = acc[r][i] * corr + p * vr[u][i];
                    m[r] = mn;
                }
            }
        }
    }
    // Merge the warp's groups: lanes with the same gl hold the same elements.
#pragma unroll
    for (int r = 0; r < NREP; ++r) {
#pragma unroll
        for (int off = GL; off < 32; off <<= 1) {
            const float mo = __shfl_xor_sync(0xffffffff, m[r], off);
            const float lo = __shfl_xor_sync(0xffffffff, l[r], off);
            const float mn = fmaxf(m[r], mo);
            const float c1 = m[r] == -INFINITY ? 0.f : expf(m[r] - mn);
            const float c2 = mo == -INFINITY ? 0.f : expf(mo - mn);
            l[r] = l[r] * c1 + lo * c2;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                const float ao = __shfl_xor_sync(0xffffffff, acc[r][i], off);
                acc[r][i] = acc[r][i] * c1 + ao * c2;
            }
            m[r] = mn;
        }
    }
    __shared__ float sm_m[NWARPS][NREP];
    __shared__ float sm_l[NWARPS][NREP];
    __shared__ float sm_acc[NWARPS][NREP][D];
#pragma unroll
    for (int r = 0; r < NREP; ++r) {
        if (lane == 0) {
            sm_m[warp][r] = m[r];
            sm_l[warp][r] = l[r];
        }
        if (group == 0) {
#pragma unroll
            for (int i = 0; i < PER; ++i) sm_acc[warp][r][gl * PER + i] = acc[r][i];
        }
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < NREP * D; idx += NWARPS * 32) {
        const int r = idx / D;
        const int d = idx % D;
        float top = -INFINITY;
        for (int w = 0; w < NWARPS; ++w) top = fmaxf(top, sm_m[w][r]);
        float sum = 0.f;
        float value = 0.f;
        for (int w = 0; w < NWARPS; ++w) {
            if (sm_m[w][r] == -INFINITY) continue;
            const float f = expf(sm_m[w][r] - top);
            sum += sm_l[w][r] * f;
            value += sm_acc[w][r][d] * f;
        }
"""

_WRITE_OUT = """
        out[((size_t)bh * NREP + r) * D + d] = static_cast<T>(value / sum);
    }
"""

# A split block leaves its unnormalized result with its running max and sum (an empty split:
# max -inf, sum 0); the combine kernel below rescales the splits to a common max.
_WRITE_PARTIAL = """
        const size_t part = ((size_t)bh * SPLITS + split) * NREP + r;
        part_acc[part * D + d] = value;
        if (d == 0) {
            part_m[part] = top;
            part_l[part] = sum;
        }
    }
"""

_COMBINE = """
    const int bhr = blockIdx.x;  // (row, KV head, query head of the group)
    const int d = threadIdx.x;
    const int bh = bhr / NREP;
    const int r = bhr % NREP;
    float top = -INFINITY;
    for (int s = 0; s < SPLITS; ++s) top = fmaxf(top, part_m[((size_t)bh * SPLITS + s) * NREP + r]);
    float sum = 0.f;
    float value = 0.f;
    for (int s = 0; s < SPLITS; ++s) {
        const size_t part = ((size_t)bh * SPLITS + s) * NREP + r;
        const float pm = part_m[part];
        if (pm == -INFINITY) continue;
        const float f = expf(pm - top);
        sum += part_l[part] * f;
        value += part_acc[part * D + d] * f;
    }
    out[(size_t)bhr * D + d] = static_cast<T>(value / sum);
"""

_INPUTS = ["queries", "keys", "values", "table", "rows", "lengths", "tail_keys", "tail_values", "scale"]


class PagedAttention:
    """``attend(queries, pool, layer, scale, ...)`` for one decode token per row.

    ``queries``: (B, Hq, 1, D); the pool layer's K/V: (slots, Hkv, D); ``lengths``: (B,)
    int32 valid positions per row. The kernel reads row ``table_rows[b]`` of the device slot
    table ``table`` (rows, max_context) for all but the last R positions, which come from
    ``tail_keys``/``tail_values`` ((B, Hkv, R, D), see ``DecodeTail``); the fallback attends to
    the (B, T) slots ``gather_index`` with ``mask`` ((B, 1, 1, T) bool).
    """

    def __init__(self, use_kernel: bool) -> None:
        self.use_kernel = use_kernel
        self._kernels: tuple | None = None
        self._scales: dict[float, mx.array] = {}

    @staticmethod
    def kernel_available() -> bool:
        """True on a CUDA GPU (the only device the custom kernel is written for)."""
        return mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()

    def supports(self, head_dim: int) -> bool:
        return self.use_kernel and head_dim % 32 == 0 and head_dim <= 256

    def attend(
        self,
        queries: mx.array,
        pool: KVPool,
        layer: int,
        scale: float,
        *,
        gather_index: mx.array | None,
        table: mx.array | None,
        table_rows: mx.array | None,
        lengths: mx.array,
        mask: mx.array | None,
        tail_keys: mx.array | None = None,
        tail_values: mx.array | None = None,
        launch: tuple[int, int] | None = None,
    ) -> mx.array:
        """``launch``: the step's (splits, warps) from ``launch_shape``; None: no split."""
        length, d = queries.shape[2], queries.shape[3]
        if not self.supports(d) or length != 1:
            assert gather_index is not None, "the fallback needs the gathered slot table"
            keys, values = pool.gather(layer, gather_index)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        assert table is not None and table_rows is not None and tail_keys is not None and tail_values is not None
        return self._kernel_attend(queries, pool.keys[layer], pool.values[layer], table, table_rows, lengths,
                                   tail_keys, tail_values, scale, launch)

    def _kernel_attend(
        self,
        queries: mx.array,
        keys_pool: mx.array,
        values_pool: mx.array,
        table: mx.array,
        table_rows: mx.array,
        lengths: mx.array,
        tail_keys: mx.array,
        tail_values: mx.array,
        scale: float,
        launch: tuple[int, int] | None = None,
    ) -> mx.array:
        b, n_q, _, d = queries.shape
        n_kv = keys_pool.shape[1]
        splits, warps = launch or launch_shape(b, n_kv, n_q // n_kv, d, 0)
        inputs = [queries, keys_pool, values_pool, table, table_rows, lengths, tail_keys, tail_values,
                  self._scale(scale)]
        return self._launch(inputs, n_kv, splits, warps)

    def _scale(self, scale: float) -> mx.array:
        scale_arr = self._scales.get(scale)
        if scale_arr is None:
            scale_arr = self._scales[scale] = mx.array([scale], dtype=mx.float32)
        return scale_arr

    def _launch(self, inputs: list[mx.array], n_kv: int, splits: int, warps: int) -> mx.array:
        queries = inputs[0]
        b, n_q, _, d = queries.shape
        n_rep = n_q // n_kv
        blocks = b * n_kv
        if self._kernels is None:
            self._kernels = (
                mx.fast.cuda_kernel(name="runtime_paged_decode", input_names=_INPUTS, output_names=["out"],
                                    source=_BODY + _WRITE_OUT, header=_HEADER),
                mx.fast.cuda_kernel(name="runtime_paged_decode_split", input_names=_INPUTS,
                                    output_names=["part_acc", "part_m", "part_l"], source=_BODY + _WRITE_PARTIAL,
                                    header=_HEADER),
                mx.fast.cuda_kernel(name="runtime_paged_decode_combine", input_names=["part_acc", "part_m", "part_l"],
                                    output_names=["out"], source=_COMBINE),
            )
        single, split, combine = self._kernels
        template = [("T", queries.dtype), ("D", d), ("NREP", n_rep), ("HKV", n_kv), ("NWARPS", warps),
                    ("UNROLL", UNROLL), ("SPLITS", splits), ("GL", lanes_per_position(d))]
        grid = (blocks * splits * warps * 32, 1, 1)
        if splits == 1:
            (out,) = single(inputs=inputs, template=template, grid=grid, threadgroup=(warps * 32, 1, 1),
                            output_shapes=[queries.shape], output_dtypes=[queries.dtype])
            return out
        parts = blocks * splits * n_rep
        part_acc, part_m, part_l = split(
            inputs=inputs, template=template, grid=grid, threadgroup=(warps * 32, 1, 1),
            output_shapes=[(parts * d,), (parts,), (parts,)], output_dtypes=[mx.float32] * 3)
        (out,) = combine(
            inputs=[part_acc, part_m, part_l],
            template=[("T", queries.dtype), ("D", d), ("NREP", n_rep), ("SPLITS", splits)],
            grid=(blocks * n_rep * d, 1, 1), threadgroup=(d, 1, 1),
            output_shapes=[queries.shape], output_dtypes=[queries.dtype])
        return out

    @staticmethod
    def variants(n_kv: int, n_rep: int, head_dim: int, max_rows: int, max_context: int,
                 row_sizes: Callable[[int], int], length_bucket: int) -> set[tuple[int, int]]:
        """Every (splits, warps) a decode batch of up to ``max_rows`` rows can use: each is a
        kernel compiled on first use, seconds on the GPU."""
        return {
            launch_shape(rows, n_kv, n_rep, head_dim, min(length, max_context))
            for rows in {row_sizes(n) for n in range(1, max_rows + 1)}
            for length in range(length_bucket, max_context + length_bucket, length_bucket)
        }

    def warm_up(self, dtype: mx.Dtype, n_kv: int, n_rep: int, head_dim: int,
                variants: set[tuple[int, int]]) -> None:
        """Compile every kernel variant now (tiny inputs), not in the middle of a request."""
        table = mx.zeros((1, 64), dtype=mx.int32)
        pool = mx.zeros((2, n_kv, head_dim), dtype=dtype)
        tail = mx.zeros((1, n_kv, 1, head_dim), dtype=dtype)
        queries = mx.zeros((1, n_kv * n_rep, 1, head_dim), dtype=dtype)
        lengths = mx.full((1,), 64, dtype=mx.int32)
        rows = mx.zeros((1,), dtype=mx.int32)
        for splits, warps in sorted(variants):
            inputs = [queries, pool, pool, table, rows, lengths, tail, tail, self._scale(1.0)]
            mx.eval(self._launch(inputs, n_kv, splits, warps))
