"""CUDA sources of the paged decode kernel's tensor-core loop (``mma``) and its helpers.

The loop (sm_80 and later, 2-byte K/V, head dims of 16s, up to 8 query heads per KV head)
takes 16 positions a warp at a time: the GQA group's scores are two m16n8k16 tiles (rows:
query heads, 8 of 16 used at most; columns: 8 positions each, K read from the pool as B
fragments), whose C registers are then the A fragment of P for ``O += P V``, V's B fragments
loaded from a per-warp shared-memory tile by ``ldmatrix.trans``. P is rounded to the K/V
dtype for its product, as cuDNN's and FlashAttention's are. ``tests/cuda_sim.py`` emulates
``mma.sync`` and ``ldmatrix`` with the PTX ISA's fragment layouts.
"""

from __future__ import annotations

# Tensor-core helpers (the mma loop, sm_80 and later): one m16n8k16 product c += a x b on
# 2-byte inputs with float accumulators, and bf16 / fp16 pairs packed into 32-bit registers.
# The CPU simulator (tests/cuda_sim.py) puts its own versions in place of these.
MMA = """
template <int UNUSED = 0>  // a template: built only where a kernel calls it (sm_80 PTX)
__device__ inline void mma16816(float* c, const unsigned* a, const unsigned* b, const __nv_bfloat16*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <int UNUSED = 0>  // a template: built only where a kernel calls it (sm_80 PTX)
__device__ inline void mma16816(float* c, const unsigned* a, const unsigned* b, const __half*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
// Four 8x8 tiles of 2-byte elements from shared memory, transposed: lanes 8m..8m+7 give the
// addresses of tile m's rows; lane L gets tile m's (rows 2 (L % 4), 2 (L % 4) + 1; column L / 4)
// in r[m], an mma B fragment when the tile's rows are k.
template <int UNUSED = 0>
__device__ inline void ldsm_x4_trans(unsigned* r, const void* row) {
    unsigned addr;
    asm volatile("{ .reg .u64 a; cvta.to.shared.u64 a, %1; cvt.u32.u64 %0, a; }" : "=r"(addr) : "l"(row));
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr) : "memory");
}
template <int UNUSED = 0>
__device__ inline unsigned pack2(float lo, float hi, const __nv_bfloat16*) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
template <int UNUSED = 0>
__device__ inline unsigned pack2(float lo, float hi, const __half*) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
"""

# Both 2-byte elements' bits in one register, ``lo`` in the low half (as mma fragments hold them).
RAW2 = """
template <typename T>
__device__ inline unsigned raw2(const T& lo, const T& hi) {
    return unsigned(*reinterpret_cast<const unsigned short*>(&lo)) |
           (unsigned(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
}
"""

# Two adjacent elements as one register: one 4-byte load where aligned.
LOAD2 = """
template <typename T>
__device__ inline unsigned load2(const T* p) {
    if ((reinterpret_cast<size_t>(p) & 3) == 0) return *reinterpret_cast<const unsigned*>(p);
    return raw2(p[0], p[1]);
}
"""

# Position t's K or V row (``{KV}``: keys or values) for the mma loop: the pool's slot, or the
# tail (appending: the old tail's first R - 1 positions, then this step's K/V).
_MMA_ROW = {
    False: "(t < n ? {KV} + ((size_t)trow[t] * HKV + h) * D : tail_{KV} + ((size_t)bh * RCAP + (t - n)) * D)",
    True: "(t < n ? {KV} + ((size_t)trow[t] * HKV + h) * D : t - n < R - 1 ? tail_{KV} + ((size_t)bh * RCAP + (t - n)) * D"
          " : new_{KV} + (size_t)bh * D)",
}

_MMA_LOOP = """
    static_assert(D % 16 == 0 && NREP <= 8, "the mma loop takes head dims of 16s and at most 8 query heads");
    constexpr int KS = D / 16;  // k-steps of the score product
    constexpr int NT = D / 8;  // n-tiles of the output
    constexpr int VROW = D + 8;  // a staged V row in elements: 16 bytes of padding against bank conflicts
    constexpr int STRIDE = NWARPS * 16;
    constexpr int VBYTES = NWARPS * 16 * VROW * (int)sizeof(T);
    constexpr int ABYTES = NWARPS * NREP * D * 4;
    __shared__ uint4 mma_smem[((VBYTES > ABYTES ? VBYTES : ABYTES) + 15) / 16];  // V tiles; sm_acc after
    T (&vtile)[NWARPS][16][VROW] = *reinterpret_cast<T (*)[NWARPS][16][VROW]>(mma_smem);
    const int g = lane / 4;  // the lane's query head (fragment row) and K position within a tile
    const int q4 = lane % 4;
    const bool head = g < NREP;
    unsigned qa[KS][2];  // Q's A fragments, row g: dims ks * 16 + 2 * q4 (+1) and 8 more
    {
        const T* qrow = queries + ((size_t)bh * NREP + (head ? g : 0)) * D;
#pragma unroll
        for (int ks = 0; ks < KS; ++ks) {
            qa[ks][0] = head ? load2(qrow + ks * 16 + 2 * q4) : 0u;
            qa[ks][1] = head ? load2(qrow + ks * 16 + 8 + 2 * q4) : 0u;
        }
    }
    float om = -INFINITY;  // head g's running max and sum
    float ol = 0.f;
    float oacc[NT][4];  // O fragments: row g, dims nt * 8 + 2 * q4 (+1); [2], [3] are rows g + 8 (unused)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) oacc[nt][0] = oacc[nt][1] = oacc[nt][2] = oacc[nt][3] = 0.f;
    for (int t0 = tbegin + warp * 16; t0 < tend; t0 += STRIDE) {
        {  // this pass's V rows into the warp's tile: two lanes a position, half a row each
            const int p = lane / 2;
            const int t = t0 + p;
            T* dst = &vtile[warp][p][(lane % 2) * (D / 2)];
            if (t < tend) {
                const T* src = {V_ROW} + (lane % 2) * (D / 2);
                if ((D / 2 * (int)sizeof(T)) % 16 == 0 && (reinterpret_cast<size_t>(src) & 15) == 0) {
#pragma unroll
                    for (int i = 0; i < D / 2 * (int)sizeof(T) / 16; ++i)
                        reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
                } else {
#pragma unroll
                    for (int i = 0; i < D / 2; ++i) dst[i] = src[i];
                }
            } else {
#pragma unroll
                for (int i = 0; i < D / 2; ++i) dst[i] = static_cast<T>(0.f);
            }
        }
        float st[2][4];  // score tiles: row g, positions t0 + j * 8 + 2 * q4 (+1)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            const int t = t0 + j * 8 + g;
            const T* krow = t < tend ? {K_ROW} : nullptr;
            st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                unsigned kb[2];
                kb[0] = krow ? load2(krow + ks * 16 + 2 * q4) : 0u;
                kb[1] = krow ? load2(krow + ks * 16 + 8 + 2 * q4) : 0u;
                const unsigned a[4] = {qa[ks][0], 0u, qa[ks][1], 0u};
                mma16816(st[j], a, kb, (const T*)nullptr);
            }
        }
        float sv[4];
        float mx = -INFINITY;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = t0 + (e / 2) * 8 + 2 * q4 + (e % 2);
            sv[e] = t < tend ? st[e / 2][e % 2] * sc : -INFINITY;
            mx = fmaxf(mx, sv[e]);
        }
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 1));
        mx = fmaxf(mx, __shfl_xor_sync(0xffffffff, mx, 2));
        const float mn = fmaxf(om, mx);
        float pv[4];
        float corr = 1.f;
        float ps = 0.f;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            pv[e] = mn == -INFINITY ? 0.f : expf(sv[e] - mn);
            ps += pv[e];
        }
        if (mn != -INFINITY) corr = expf(om - mn);
        ps += __shfl_xor_sync(0xffffffff, ps, 1);
        ps += __shfl_xor_sync(0xffffffff, ps, 2);
        ol = ol * corr + ps;
        om = mn;
        const unsigned pa[4] = {pack2(pv[0], pv[1], (const T*)nullptr), 0u, pack2(pv[2], pv[3], (const T*)nullptr), 0u};
        __syncwarp();  // the V tile is written
#pragma unroll
        for (int nt = 0; nt < NT; nt += 2) {
            // V's B fragments of n-tiles nt and nt + 1: tiles (positions 0-7 | 8-15) x (dims of nt | nt + 1)
            unsigned vb[4];
            const int m = lane / 8;
            ldsm_x4_trans(vb, &vtile[warp][(m % 2) * 8 + lane % 8][(nt + m / 2) * 8]);
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                oacc[nt][e] *= corr;
                oacc[nt + 1][e] *= corr;
            }
            mma16816(oacc[nt], pa, vb, (const T*)nullptr);
            mma16816(oacc[nt + 1], pa, vb + 2, (const T*)nullptr);
        }
        __syncwarp();  // the V tile is read before the next pass writes it
    }
"""

# The mma loop's results into the block merge's shared memory (reusing the V tiles' memory).
MMA_WARP_OUT = """
    __shared__ float sm_m[NWARPS][NREP];
    __shared__ float sm_l[NWARPS][NREP];
    __syncthreads();  // every warp is done with its V tile, whose memory holds sm_acc now
    float (&sm_acc)[NWARPS][NREP][D] = *reinterpret_cast<float (*)[NWARPS][NREP][D]>(mma_smem);
    if (head) {
        if (q4 == 0) {
            sm_m[warp][g] = om;
            sm_l[warp][g] = ol;
        }
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
            sm_acc[warp][g][nt * 8 + 2 * q4] = oacc[nt][0];
            sm_acc[warp][g][nt * 8 + 2 * q4 + 1] = oacc[nt][1];
        }
    }
"""


def mma_loop_source(appending: bool) -> str:
    """The mma loop's source, reading the tail or (``appending``) the old tail and this step's K/V."""
    row = _MMA_ROW[appending]
    return _MMA_LOOP.replace("{V_ROW}", row.replace("{KV}", "values")).replace("{K_ROW}", row.replace("{KV}", "keys"))
