"""Decode attention that reads K/V straight from the pool through a slot table.

On a CUDA device this is one custom kernel per layer: no gathered copy of K/V, no mask
array (MLX's fused decode kernel refuses array masks, so a masked batch would fall back
to unfused matmul + softmax), and far fewer kernels to launch per step. Elsewhere it is
the gather + masked ``mx.fast.scaled_dot_product_attention`` the worker always used.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.worker.kv_pool import KVPool

UNROLL = 4
SHARED_BYTES = 40 * 1024  # the per-warp partial results live in static shared memory (48 KiB max)


def warps_for(blocks: int, n_rep: int, head_dim: int) -> int:
    """Warps per (row, kv head) block: more when few blocks would leave the GPU idle."""
    warps = 16 if blocks < 264 else 8
    while warps > 1 and warps * n_rep * head_dim * 4 > SHARED_BYTES:
        warps //= 2
    return warps

_SOURCE = """
    constexpr int PER = D / 32;
    const int b = blockIdx.x / HKV;
    const int h = blockIdx.x % HKV;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int tcap = table_shape[1];
    const int R = tail_keys_shape[2];
    const int n = lengths[b] - R;  // positions in the pool; the last R are in the tail
    const int total = n + R;
    const float sc = scale[0];
    float qr[NREP][PER];
    float acc[NREP][PER];
    float m[NREP];
    float l[NREP];
    for (int r = 0; r < NREP; ++r) {
        const size_t qbase = ((size_t)(b * HKV + h) * NREP + r) * D + lane * PER;
        for (int i = 0; i < PER; ++i) {
            qr[r][i] = static_cast<float>(queries[qbase + i]) * sc;
            acc[r][i] = 0.f;
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int* trow = table + (size_t)rows[b] * tcap;
    // Each warp takes UNROLL consecutive positions per pass: their loads are issued
    // together, so a warp waits for memory once per pass instead of once per position.
    for (int t0 = warp * UNROLL; t0 < total; t0 += NWARPS * UNROLL) {
        float kr[UNROLL][PER];
        float vr[UNROLL][PER];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t0 + u;
            if (t < n) {
                const size_t base = ((size_t)trow[t] * HKV + h) * D + lane * PER;
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    kr[u][i] = static_cast<float>(keys[base + i]);
                    vr[u][i] = static_cast<float>(values[base + i]);
                }
            } else if (t < total) {
                const size_t base = ((size_t)(b * HKV + h) * R + (t - n)) * D + lane * PER;
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    kr[u][i] = static_cast<float>(tail_keys[base + i]);
                    vr[u][i] = static_cast<float>(tail_values[base + i]);
                }
            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            if (t0 + u >= total) break;  // uniform across the warp
            for (int r = 0; r < NREP; ++r) {
                float s = 0.f;
                for (int i = 0; i < PER; ++i) s += qr[r][i] * kr[u][i];
                for (int off = 16; off > 0; off >>= 1) s += __shfl_xor_sync(0xffffffff, s, off);
                const float mn = fmaxf(m[r], s);
                const float corr = expf(m[r] - mn);
                const float p = expf(s - mn);
                l[r] = l[r] * corr + p;
                for (int i = 0; i < PER; ++i) acc[r][i] = acc[r][i] * corr + p * vr[u][i];
                m[r] = mn;
            }
        }
    }
    __shared__ float sm_m[NWARPS][NREP];
    __shared__ float sm_l[NWARPS][NREP];
    __shared__ float sm_acc[NWARPS][NREP][D];
    for (int r = 0; r < NREP; ++r) {
        if (lane == 0) {
            sm_m[warp][r] = m[r];
            sm_l[warp][r] = l[r];
        }
        for (int i = 0; i < PER; ++i) sm_acc[warp][r][lane * PER + i] = acc[r][i];
    }
    __syncthreads();
    for (int idx = threadIdx.x; idx < NREP * D; idx += NWARPS * 32) {
        const int r = idx / D;
        const int d = idx % D;
        float top = -INFINITY;
        for (int w = 0; w < NWARPS; ++w) top = fmaxf(top, sm_m[w][r]);
        float total = 0.f;
        float value = 0.f;
        for (int w = 0; w < NWARPS; ++w) {
            if (sm_m[w][r] == -INFINITY) continue;
            const float f = expf(sm_m[w][r] - top);
            total += sm_l[w][r] * f;
            value += sm_acc[w][r][d] * f;
        }
        out[((size_t)(b * HKV + h) * NREP + r) * D + d] = static_cast<T>(value / total);
    }
"""


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
        self._kernel = None
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
    ) -> mx.array:
        length, d = queries.shape[2], queries.shape[3]
        if not self.supports(d) or length != 1:
            assert gather_index is not None, "the fallback needs the gathered slot table"
            keys, values = pool.gather(layer, gather_index)
            return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)
        assert table is not None and table_rows is not None and tail_keys is not None and tail_values is not None
        return self._kernel_attend(queries, pool.keys[layer], pool.values[layer], table, table_rows, lengths,
                                   tail_keys, tail_values, scale)

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
    ) -> mx.array:
        b, n_q, _, d = queries.shape
        n_kv = keys_pool.shape[1]
        if self._kernel is None:
            self._kernel = mx.fast.cuda_kernel(
                name="runtime_paged_decode",
                input_names=["queries", "keys", "values", "table", "rows", "lengths", "tail_keys", "tail_values",
                             "scale"],
                output_names=["out"],
                source=_SOURCE,
            )
        scale_arr = self._scales.get(scale)
        if scale_arr is None:
            scale_arr = self._scales[scale] = mx.array([scale], dtype=mx.float32)
        warps = warps_for(b * n_kv, n_q // n_kv, d)
        (out,) = self._kernel(
            inputs=[queries, keys_pool, values_pool, table, table_rows, lengths, tail_keys, tail_values, scale_arr],
            template=[("T", queries.dtype), ("D", d), ("NREP", n_q // n_kv), ("HKV", n_kv), ("NWARPS", warps),
                      ("UNROLL", UNROLL)],
            grid=(b * n_kv * warps * 32, 1, 1),
            threadgroup=(warps * 32, 1, 1),
            output_shapes=[queries.shape],
            output_dtypes=[queries.dtype],
        )
        return out
