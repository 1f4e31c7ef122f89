"""CUDA source of the paged decode kernel's lane-per-position loop (``loop="lanes"``).

The other loops (``paged_kernels``) spread one position's K/V row over a group of lanes, so
every score is a shuffle reduction and every lane of a group repeats the softmax. Here a
warp takes a tile of 32 positions, one per lane:

* scores: each lane reads its position's whole K row and dots it with every query head of
  the GQA group, read from shared memory (a broadcast): no shuffles;
* softmax: one max over the tile per query head (a warp reduction), one ``expf`` per
  position and head, the running sum kept per lane;
* values: the lanes own D / 32 elements each and walk the tile's positions, ``UNROLL`` rows
  of V loaded at once, each position's weight and slot broadcast by shuffles.

The block's warps merge through shared memory as in ``paged_kernels`` (``BLOCK_MERGE``), and
the write-out (whole, or a split's partial result) is the same, so the combine kernel and
``PagedAttention``'s launch rules serve both.
"""

from __future__ import annotations

from runtime.worker.paths.cuda.paged_kernels import (
    APPEND_COPY,
    APPEND_LENGTH,
    BLOCK_MERGE,
    TAIL_LENGTH,
)

# N contiguous elements as floats: 16-, 8- or 4-byte loads where N fills them and the address
# is aligned, else one element at a time.
HEADER = """
template <typename T, int N>
__device__ inline void load_small(const T* p, float* out) {
    constexpr int BYTES = N * sizeof(T);
    const size_t addr = reinterpret_cast<size_t>(p);
    if (BYTES % 16 == 0 && (addr & 15) == 0) {
#pragma unroll
        for (int j = 0; j < BYTES / 16; ++j) {
            const uint4 raw = reinterpret_cast<const uint4*>(p)[j];
            const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
            for (int k = 0; k < 16 / (int)sizeof(T); ++k) out[j * (16 / sizeof(T)) + k] = static_cast<float>(e[k]);
        }
    } else if (BYTES == 8 && (addr & 7) == 0) {
        const uint2 raw = *reinterpret_cast<const uint2*>(p);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = static_cast<float>(e[k]);
    } else if (BYTES == 4 && (addr & 3) == 0) {
        const unsigned int raw = *reinterpret_cast<const unsigned int*>(p);
        const T* e = reinterpret_cast<const T*>(&raw);
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = static_cast<float>(e[k]);
    } else {
#pragma unroll
        for (int k = 0; k < N; ++k) out[k] = static_cast<float>(p[k]);
    }
}
"""

_BODY = """
    constexpr int DL = D / 32;  // value elements per lane
    constexpr int E = 16 / sizeof(T);  // key elements per 16-byte load
    const int SPLITS = gridDim.x / (queries_shape[0] * HKV);  // the grid is (rows x KV heads x splits) blocks
    const int bh = blockIdx.x / SPLITS;
    const int split = blockIdx.x % SPLITS;
    const int b = bh / HKV;
    const int h = bh % HKV;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int tcap = table_shape[1];
{TAIL_LENGTH}    const int n = lengths[b] - R;  // positions in the pool; the last R are in the tail
    const int total = n + R;
    const int chunk = (total + SPLITS - 1) / SPLITS;
    const int tbegin = split * chunk;
    const int tend = min(total, tbegin + chunk);
    const int* trow = table + (size_t)rows[b] * tcap;
    __shared__ __align__(16) float sq[NREP][D];
    for (int idx = threadIdx.x; idx < NREP * D; idx += NWARPS * 32) {
        sq[idx / D][idx % D] = static_cast<float>(queries[(size_t)bh * NREP * D + idx]) * scale[0];
    }
{TAIL_COPY}    __syncthreads();
    float acc[NREP][DL];
    float m[NREP];
    float l[NREP];  // this lane's share of the running sum (m is the same in every lane)
#pragma unroll
    for (int r = 0; r < NREP; ++r) {
#pragma unroll
        for (int i = 0; i < DL; ++i) acc[r][i] = 0.f;
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    for (int base = tbegin + warp * 32; base < tend; base += NWARPS * 32) {  // base < tend: lane 0 is live
        const int t = base + lane;
        const bool live = t < tend;
        const int slot = live && t < n ? trow[t] : 0;
        float s[NREP];
#pragma unroll
        for (int r = 0; r < NREP; ++r) s[r] = 0.f;
        if (live) {
            const T* kp = {KEY_ROW};
#pragma unroll
            for (int c = 0; c < D / E; ++c) {
                float k[E];
                load_small<T, E>(kp + c * E, k);
#pragma unroll
                for (int r = 0; r < NREP; ++r) {
#pragma unroll
                    for (int e = 0; e < E; ++e) s[r] += sq[r][c * E + e] * k[e];
                }
            }
        }
        float p[NREP];
#pragma unroll
        for (int r = 0; r < NREP; ++r) {
            float top = live ? s[r] : -INFINITY;
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) top = fmaxf(top, __shfl_xor_sync(0xffffffff, top, off));
            const float mn = fmaxf(m[r], top);
            const float corr = expf(m[r] - mn);
            p[r] = live ? expf(s[r] - mn) : 0.f;
            l[r] = l[r] * corr + p[r];
#pragma unroll
            for (int i = 0; i < DL; ++i) acc[r][i] *= corr;
            m[r] = mn;
        }
        const int count = min(32, tend - base);
        for (int u0 = 0; u0 < count; u0 += UNROLL) {
            float v[UNROLL][DL];
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
                const int u = u0 + j;
                const int su = __shfl_sync(0xffffffff, slot, u & 31);
                if (u < count) {
                    const int tu = base + u;
                    const T* vp = {VALUE_ROW};
                    load_small<T, DL>(vp + lane * DL, v[j]);
                } else {
#pragma unroll
                    for (int i = 0; i < DL; ++i) v[j][i] = 0.f;
                }
            }
#pragma unroll
            for (int j = 0; j < UNROLL; ++j) {
#pragma unroll
                for (int r = 0; r < NREP; ++r) {
                    const float pu = __shfl_sync(0xffffffff, p[r], (u0 + j) & 31);
#pragma unroll
                    for (int i = 0; i < DL; ++i) acc[r][i] += pu * v[j][i];
                }
            }
        }
    }
    __shared__ float sm_m[NWARPS][NREP];
    __shared__ float sm_l[NWARPS][NREP];
    __shared__ float sm_acc[NWARPS][NREP][D];
#pragma unroll
    for (int r = 0; r < NREP; ++r) {
        float sum = l[r];
#pragma unroll
        for (int off = 16; off > 0; off >>= 1) sum += __shfl_xor_sync(0xffffffff, sum, off);
        if (lane == 0) {
            sm_m[warp][r] = m[r];
            sm_l[warp][r] = sum;
        }
#pragma unroll
        for (int i = 0; i < DL; ++i) sm_acc[warp][r][lane * DL + i] = acc[r][i];
    }
"""

# The first element of position T's K or V row (slot S where T is in the pool): the pool,
# else the tail; appending, the tail's first R - 1 positions are the old tail and the last
# one this step's K/V.
_ROW = "({T} < n ? {POOL} + ((size_t)({S}) * HKV + h) * D : {TAIL} + ((size_t)bh * RCAP + ({T} - n)) * D)"
_APPEND_ROW = ("({T} < n ? {POOL} + ((size_t)({S}) * HKV + h) * D : {T} - n < R - 1 ? "
               "{TAIL} + ((size_t)bh * RCAP + ({T} - n)) * D : {NEW} + (size_t)bh * D)")


def _row(appending: bool, position: str, slot: str, pool: str, tail: str, new: str) -> str:
    text = _APPEND_ROW if appending else _ROW
    return text.replace("{T}", position).replace("{S}", slot).replace("{POOL}", pool).replace(
        "{TAIL}", tail).replace("{NEW}", new)


def lanes_body(appending: bool) -> str:
    """The lane-per-position kernel body up to its write-out (``paged_kernels.WRITE_OUT`` or
    ``WRITE_PARTIAL``): reading a separate tail, or appending to it."""
    parts = {
        "{TAIL_LENGTH}": APPEND_LENGTH if appending else TAIL_LENGTH,
        "{TAIL_COPY}": APPEND_COPY if appending else "",
        "{KEY_ROW}": _row(appending, "t", "slot", "keys", "tail_keys", "new_keys"),
        "{VALUE_ROW}": _row(appending, "tu", "su", "values", "tail_values", "new_values"),
    }
    source = _BODY
    for marker, text in parts.items():
        source = source.replace(marker, text)
    return source + BLOCK_MERGE
