"""CUDA sources of the paged decode kernel (``PagedAttention`` compiles and launches them).

Template parameters: ``T`` (K/V and query dtype), ``D`` (head dim), ``NREP`` (query heads per
KV head), ``HKV`` (KV heads), ``NWARPS`` (warps per block), ``UNROLL`` (positions per lane
group and pass), ``GL`` (lanes per position). ``SPLITS`` (blocks per row and KV head) is read
from the launch's grid, not a template parameter: one built kernel serves every split count,
so a worker's start builds fewer (each build is seconds of NVRTC, at every start: MLX keeps
custom kernels in memory only).
"""

from __future__ import annotations

from runtime.worker.paths.cuda.paged_loops import loop_source
from runtime.worker.paths.cuda.paged_mma import MMA_LOOPS, MMA_WARP_OUT
from runtime.worker.paths.cuda.paged_stages import ROPE_STAGE
from runtime.worker.paths.cuda.tensor_core import LOAD_CHUNK, MMA, RAW2

# One block per (row, KV head, split). A warp works on 32 / GL positions at once: each
# group of GL lanes holds one position's K/V row (PER = D / GL elements per lane, loaded as
# 16-byte vectors where aligned), so a dot product needs log2(GL) shuffles, not five. Every
# group keeps an online softmax per query head of the GQA group in float32; the groups of a
# warp are merged by shuffles, then the block's warps through shared memory.
HEADER = """
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

// One position's K and V elements of a lane, kept as loaded (16-byte words where N elements
// fill whole words) and converted to float only when used: a prefetched pass costs half the
// registers of a converted one.
template <typename T, int N>
struct KVRow {
    static constexpr int V = 16 / sizeof(T);
    static constexpr bool RAW = N % V == 0;
    static constexpr int W = RAW ? N / V : 1;
    uint4 k[W];
    uint4 v[W];
    float fk[RAW ? 1 : N];
    float fv[RAW ? 1 : N];
    __device__ inline void load(const T* kp, const T* vp) {
        if (RAW && ((reinterpret_cast<size_t>(kp) | reinterpret_cast<size_t>(vp)) & 15) == 0) {
#pragma unroll
            for (int j = 0; j < W; ++j) {
                k[j] = reinterpret_cast<const uint4*>(kp)[j];
                v[j] = reinterpret_cast<const uint4*>(vp)[j];
            }
        } else if (RAW) {
            T* ke = reinterpret_cast<T*>(k);
            T* ve = reinterpret_cast<T*>(v);
#pragma unroll
            for (int i = 0; i < N; ++i) {
                ke[i] = kp[i];
                ve[i] = vp[i];
            }
        } else {
#pragma unroll
            for (int i = 0; i < N; ++i) {
                fk[i] = static_cast<float>(kp[i]);
                fv[i] = static_cast<float>(vp[i]);
            }
        }
    }
    __device__ inline void zero() {
#pragma unroll
        for (int j = 0; j < W; ++j) k[j] = v[j] = make_uint4(0, 0, 0, 0);
        if (!RAW) {
#pragma unroll
            for (int i = 0; i < N; ++i) fk[i] = fv[i] = 0.f;
        }
    }
    __device__ inline float key(int i) const {
        return RAW ? static_cast<float>(reinterpret_cast<const T*>(k)[i]) : fk[i];
    }
    __device__ inline float value(int i) const {
        return RAW ? static_cast<float>(reinterpret_cast<const T*>(v)[i]) : fv[i];
    }
};
"""

HEADER = MMA + RAW2 + LOAD_CHUNK + HEADER


def register_cap(registers: int) -> str:
    """A header prefix that caps the kernel after it at ``registers`` 32-bit registers a lane
    (``__maxnreg__``, CUDA 12.4 on; what ``-maxrregcount`` does for a whole build), or "" for 0,
    the compiler's choice. MLX writes the kernel's ``__global__`` line itself, so the cap rides
    on that macro. Fewer registers let more warps share an SM (to hide the load latency a
    one-row split launch waits on) at the price of spills: ``scripts/nvrtc_check.py`` reports both."""
    if registers <= 0:
        return ""
    return f"#undef __global__\n#define __global__ __location__(global) __maxnreg__({registers})\n"

_PROLOGUE = """
    constexpr int PER = D / GL;
    constexpr int GROUPS = 32 / GL;
    const int SPLITS = gridDim.x / (queries_shape[0] * HKV);  // the grid is (rows x KV heads x splits) blocks
    const int bh = blockIdx.x / SPLITS;
    const int split = blockIdx.x % SPLITS;
    const int b = bh / HKV;
    const int h = bh % HKV;
    const int warp = threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int group = lane / GL;
    const int gl = lane % GL;
    const int tcap = table_shape[1];
    const T* qblock = queries + (size_t)bh * NREP * D;  // the block's query heads, D apart
{NEW_ROWS}{TAIL_LENGTH}    const int n = lengths[b] - R;  // positions in the pool; the last R are in the tail
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
        const size_t qbase = (size_t)r * D + gl * PER;
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            qr[r][i] = static_cast<float>(qblock[qbase + i]) * sc;
            acc[r][i] = 0.f;
        }
        m[r] = -INFINITY;
        l[r] = 0.f;
    }
    const int* trow = table + (size_t)rows[b] * tcap;
{TAIL_COPY}"""

_GROUP_MERGE = """
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
"""

# Each warp's running max, sum and accumulator per query head, for the block merge.
WARP_SHARED = """    __shared__ float sm_m[NWARPS][NREP];
    __shared__ float sm_l[NWARPS][NREP];
    __shared__ float sm_acc[NWARPS][NREP][D];
"""

# A CUDA-core loop's warp results (merged over its lane groups) into WARP_SHARED.
_GROUP_OUT = """#pragma unroll
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
"""

# The block's warps merged: each warp has left its running max sm_m, sum sm_l and accumulator
# sm_acc per query head of the group.
_BLOCK_MERGE = """
    // The block's warps, through shared memory, up to each output element's write
    // (WRITE_OUT or WRITE_PARTIAL closes the loop).
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

WRITE_OUT = """
        out[((size_t)bh * NREP + r) * D + d] = static_cast<T>(value / sum);
    }
"""

# Attention sinks (gpt-oss): one more logit per query head, ``sinks[head]`` (float32), in the
# softmax's denominator only, as MLX's attention takes ``sinks``. It is merged into the block's
# running max and sum as a position whose value row is zero, by the unsplit block or by split 0
# of a split launch (the combine kernel then merges it as it merges any split's). Goes between
# the block merge and WRITE_OUT / WRITE_PARTIAL; inputs ``kernel_inputs(..., sinks=True)``.
SINK_MERGE = """
        if (split == 0) {
            const float sink = sinks[h * NREP + r];
            const float next = fmaxf(top, sink);
            const float f = top == -INFINITY ? 0.f : expf(top - next);
            sum = sum * f + expf(sink - next);
            value *= f;
            top = next;
        }
"""

# A split block leaves its unnormalized result with its running max and sum (an empty split:
# max -inf, sum 0); the combine kernel below rescales the splits to a common max.
WRITE_PARTIAL = """
        const size_t part = ((size_t)bh * SPLITS + split) * NREP + r;
        part_acc[part * D + d] = value;
        if (d == 0) {
            part_m[part] = top;
            part_l[part] = sum;
        }
    }
"""

# Splits a combine block can merge (``PagedAttention`` checks a launch against it).
COMBINE_MAX_SPLITS = 256
# Up to this many splits each combine thread reads the maxima and sums itself: on an H200 the
# shared-memory rounds cost more than they save there (4 splits: 3.2-3.9 against 2.4-2.7 us a
# call; 32 splits: 4.8-5.1 against 7.0-7.3 us).
FEW_SPLITS = 8

# One block per (row, KV head, query head of the group), one thread per head dim. Beyond a few
# splits, their maxima and sums are read by the block's threads side by side into shared
# memory, and each thread's loads of its dim over the splits are independent of one another:
# one thread reading every split's max, then every sum and value in turn waits for each load.
# Either way the sums run in split order, with the same factors (the same bits).
COMBINE = f"""
    constexpr int FEW_SPLITS = {FEW_SPLITS};
    constexpr int MAX_SPLITS = {COMBINE_MAX_SPLITS};
    __shared__ float weight[MAX_SPLITS];  // each split's max, then its factor exp(max - top)
    __shared__ float scaled[MAX_SPLITS];  // each split's sum times its factor
    const int bhr = blockIdx.x;  // (row, KV head, query head of the group)
    const int SPLITS = part_m_shape[0] / gridDim.x;  // partial results per (row, KV head, query head)
    const int d = threadIdx.x;
    const int bh = bhr / NREP;
    const int r = bhr % NREP;
    const size_t first = (size_t)bh * SPLITS * NREP + r;  // split s's partial result: first + s * NREP
    float sum = 0.f;
    float value = 0.f;
    if (SPLITS <= FEW_SPLITS) {{  // each thread reads the few maxima and sums itself
        float top = -INFINITY;
        for (int s = 0; s < SPLITS; ++s) top = fmaxf(top, part_m[first + (size_t)s * NREP]);
        for (int s = 0; s < SPLITS; ++s) {{
            const float pm = part_m[first + (size_t)s * NREP];
            if (pm == -INFINITY) continue;  // an empty split: nothing to add
            const float f = expf(pm - top);
            sum += part_l[first + (size_t)s * NREP] * f;
            value += part_acc[(first + (size_t)s * NREP) * D + d] * f;
        }}
    }} else {{
        for (int s = d; s < SPLITS; s += D) weight[s] = part_m[first + (size_t)s * NREP];
        __syncthreads();
        float top = -INFINITY;
        for (int s = 0; s < SPLITS; ++s) top = fmaxf(top, weight[s]);
        __syncthreads();  // every thread has its max before the maxima become factors
        for (int s = d; s < SPLITS; s += D) {{
            const float pm = weight[s];
            const float f = pm == -INFINITY ? 0.f : expf(pm - top);
            weight[s] = f;
            scaled[s] = f == 0.f ? 0.f : part_l[first + (size_t)s * NREP] * f;
        }}
        __syncthreads();
#pragma unroll 8
        for (int s = 0; s < SPLITS; ++s) {{
            const float f = weight[s];
            if (f == 0.f) continue;  // an empty split (its max -inf): nothing to add
            sum += scaled[s];
            value += part_acc[(first + (size_t)s * NREP) * D + d] * f;
        }}
    }}
    out[(size_t)bhr * D + d] = static_cast<T>(value / sum);
"""

INPUTS = ["queries", "keys", "values", "table", "rows", "lengths", "tail_keys", "tail_values", "tail_len", "scale"]
APPEND_INPUTS = INPUTS[:-1] + ["new_keys", "new_values", "scale"]
APPEND_OUTPUTS = ["keys_out", "values_out"]
# The appending kernel that also rotates this step's queries and new keys (``ROPE_STAGE``): each
# row's position, [RoPE scale, log2(base)] as float32, and the frequencies (ROPE 2; else unused).
ROPE_INPUTS = APPEND_INPUTS + ["positions", "rope_consts", "rope_freqs"]


def kernel_inputs(appending: bool, rope: bool = False, sinks: bool = False) -> list[str]:
    """The decode kernel's input names: reading a tail or appending to it (and rotating), and
    the sinks last for a model with attention sinks (``SINK_MERGE``)."""
    names = ROPE_INPUTS if rope else APPEND_INPUTS if appending else INPUTS
    return names + ["sinks"] if sinks else names

# The tail (B, HKV, RCAP, D), of capacity RCAP, holds a row's last R = tail_len[0] positions (the
# rest of it is unused): its length is a run-time value, so one compiled step serves every
# tail length.
_TAIL_LENGTH = "    const int RCAP = tail_keys_shape[2];\n    const int R = tail_len[0];\n"
# Appending: the last position is this step's new_keys/new_values (B, HKV, 1, D), the
# R - 1 = tail_len[0] before it the old tail (capacity RCAP); the blocks also write old tail + new
# row to the first R positions of keys_out / values_out (B, HKV, RCAP, D), the step's tail, so no
# separate concatenation is launched.
_APPEND_LENGTH = "    const int RCAP = tail_keys_shape[2];\n    const int R = tail_len[0] + 1;\n"
# This step's K/V rows of the block's (row, KV head); ROPE_STAGE points the key row (and the
# queries) at their rotated copies.
_NEW_ROWS = """    const T* new_keys_row = new_keys + (size_t)bh * D;
    const T* new_values_row = new_values + (size_t)bh * D;
"""
_APPEND_COPY = """
    {
        // Every block of the (row, KV head) copies a share, 16 bytes per thread and load where
        // aligned; a thread issues both loads before its stores (one memory wait, not R * 2).
        const size_t old_base = (size_t)bh * RCAP * D;
        const size_t out_base = (size_t)bh * RCAP * D;
        constexpr int V = 16 / sizeof(T);
        const bool vec = D % V == 0 && ((reinterpret_cast<size_t>(tail_keys + old_base) |
            reinterpret_cast<size_t>(tail_values + old_base) | reinterpret_cast<size_t>(new_keys_row) |
            reinterpret_cast<size_t>(new_values_row) | reinterpret_cast<size_t>(keys_out + out_base) |
            reinterpret_cast<size_t>(values_out + out_base)) & 15) == 0;
        const int step = vec ? V : 1;
        const int old_n = (R - 1) * D;
        for (int e = (split * NWARPS * 32 + threadIdx.x) * step; e < R * D; e += SPLITS * NWARPS * 32 * step) {
            const T* ks = e < old_n ? tail_keys + old_base + e : new_keys_row + (e - old_n);
            const T* vs = e < old_n ? tail_values + old_base + e : new_values_row + (e - old_n);
            if (vec) {
                const uint4 kv = *reinterpret_cast<const uint4*>(ks);
                const uint4 vv = *reinterpret_cast<const uint4*>(vs);
                *reinterpret_cast<uint4*>(keys_out + out_base + e) = kv;
                *reinterpret_cast<uint4*>(values_out + out_base + e) = vv;
            } else {
                const T kv = *ks;
                const T vv = *vs;
                keys_out[out_base + e] = kv;
                values_out[out_base + e] = vv;
            }
        }
    }
"""


def body(appending: bool, loop: str = "pipelined", rope: bool = False) -> str:
    """The kernel body up to its write-out, reading a separate tail or appending to it, with
    ``loop`` (``paged_loops.loop_source``: classic, pipelined, mma or mma_ahead); ``rope``
    (appending only): the queries and new keys come unrotated and the kernel rotates them
    (``ROPE_STAGE``, template parameters ROPE, ROPE_DIMS, ROPE_TRAD; inputs ``ROPE_INPUTS``)."""
    assert appending or not rope, "only the appending kernel rotates"
    if appending:
        parts = {"{NEW_ROWS}": _NEW_ROWS + (ROPE_STAGE if rope else ""), "{TAIL_LENGTH}": _APPEND_LENGTH,
                 "{TAIL_COPY}": _APPEND_COPY}
    else:
        parts = {"{NEW_ROWS}": "", "{TAIL_LENGTH}": _TAIL_LENGTH, "{TAIL_COPY}": ""}
    warp_out = "\n" + WARP_SHARED + MMA_WARP_OUT if loop in MMA_LOOPS else _GROUP_MERGE + WARP_SHARED + _GROUP_OUT
    source = _PROLOGUE + loop_source(loop, appending) + warp_out + _BLOCK_MERGE
    for marker, text in parts.items():
        source = source.replace(marker, text)
    return source
