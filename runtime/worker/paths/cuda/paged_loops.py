"""CUDA sources of the paged decode kernel's main loop over positions (``paged_kernels.body``).

Each loop walks a block's positions in warp passes of ``GROUPS * UNROLL`` positions (a group
of GL lanes per position, see ``paged_kernels``) and leaves each lane's running max ``m``,
sum ``l`` and accumulator ``acc`` for the epilogue:

* ``classic``: a pass's K/V loaded, then scored, with a rescale per position;
* ``pipelined``: the next pass's loads issued before this pass is scored, one rescale per
  pass (10-17% faster than classic on an H200); its register copy of the prefetched pass at
  the end of each iteration waits for those loads, so it keeps about one pass in flight;
* ``mma``: tensor cores (sm_80 and later, 2-byte K/V, up to 8 query heads per KV head): a
  warp takes 16 positions at a time; the scores of the GQA group are two m16n8k16 tiles
  (rows: query heads; columns: 8 positions each, K read from the pool as B fragments), whose
  registers are then the A fragment of P for ``O += P V`` (V staged in shared memory).

Ring loops (N buffers taken in turn, unrolled, N - 1 passes ahead) were measured on an H200 in
session 19 and removed: no faster than ``pipelined`` at any size (ring3 at 1 x 32k: 161 against
151 us), ring4 could not launch 16 warps. So was a ``staged`` loop (each lane's K/V of the next
3 passes copied into shared memory with cp.async, no registers held): no faster at any size
(147 against 135 us at 1 x 32k). The kernel is bound by its instructions, not by memory latency.
"""

from __future__ import annotations

# Every loop's first lines: the warp's first position and the table's slots of its first pass.
_LOOP_START = """
    constexpr int STRIDE = NWARPS * GROUPS * UNROLL;
    const int tfirst = tbegin + warp * GROUPS * UNROLL;
    const int pool_end = min(tend, n);
    int slot[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int t = tfirst + u * GROUPS + group;
        slot[u] = t < pool_end ? trow[t] : 0;
    }
"""

_CLASSIC_LOOP = """
    // A warp pass covers GROUPS * UNROLL consecutive positions; all its loads are issued
    // before any is used, so a warp waits for memory once per pass. The slots of the next
    // pass are read from the table while this pass's K/V are loading.
{LOOP_START}    for (int t0 = tfirst; t0 < tend; t0 += STRIDE) {
        float kr[UNROLL][PER];
        float vr[UNROLL][PER];
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t0 + u * GROUPS + group;
            if (t >= tend) {
#pragma unroll
                for (int i = 0; i < PER; ++i) kr[u][i] = vr[u][i] = 0.f;
            } else if (t < n) {
                const size_t base = ((size_t)slot[u] * HKV + h) * D + gl * PER;
                load_row<T, PER>(keys + base, kr[u]);
                load_row<T, PER>(values + base, vr[u]);
            } else {
{TAIL_LOAD}            }
        }
#pragma unroll
        for (int u = 0; u < UNROLL; ++u) {
            const int t = t0 + STRIDE + u * GROUPS + group;
            slot[u] = t < pool_end ? trow[t] : 0;
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
"""

_PIPELINED_LOOP = """
    // Software-pipelined: pass i + 1's loads are issued (kept as loaded, KVRow) before pass i
    // is scored; a pass's GROUPS * UNROLL positions get one online-softmax rescale per query
    // head. The copy nxt -> cur at the end waits for those loads (see the module docstring).
{LOOP_START}    KVRow<T, PER> cur[UNROLL];
    KVRow<T, PER> nxt[UNROLL];
{FETCH_FIRST}    for (int t0 = tfirst; t0 < tend; t0 += STRIDE) {
        if (t0 + STRIDE < tend) {  // uniform across the warp
{FETCH_NEXT}        }
{COMPUTE}#pragma unroll
        for (int u = 0; u < UNROLL; ++u) cur[u] = nxt[u];
    }
"""

# One warp pass's scoring and online-softmax rescale (the pipelined loop): positions
# T0 + u * GROUPS + group, their K/V in CUR.
_PASS = """
#pragma unroll
        for (int r = 0; r < NREP; ++r) {
            float s[UNROLL];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) {
                float dot = 0.f;
#pragma unroll
                for (int i = 0; i < PER; ++i) dot += qr[r][i] * CUR[u].key(i);
#pragma unroll
                for (int off = GL / 2; off > 0; off >>= 1) dot += __shfl_xor_sync(0xffffffff, dot, off);
                s[u] = T0 + u * GROUPS + group < tend ? dot : -INFINITY;
            }
            float mn = m[r];
#pragma unroll
            for (int u = 0; u < UNROLL; ++u) mn = fmaxf(mn, s[u]);
            if (mn != -INFINITY) {
                const float corr = expf(m[r] - mn);
                float p[UNROLL];
                float psum = 0.f;
#pragma unroll
                for (int u = 0; u < UNROLL; ++u) {
                    p[u] = expf(s[u] - mn);
                    psum += p[u];
                }
                l[r] = l[r] * corr + psum;
#pragma unroll
                for (int i = 0; i < PER; ++i) {
                    float a = acc[r][i] * corr;
#pragma unroll
                    for (int u = 0; u < UNROLL; ++u) a += p[u] * CUR[u].value(i);
                    acc[r][i] = a;
                }
                m[r] = mn;
            }
        }
"""

# A lane's loads of a position past the pool (``t >= n``): the separate tail, or (appending)
# the old tail's first R - 1 positions and then this step's K/V. Each is the lines that find
# the row, and its K and V row pointers.
_TAIL_ROW = ("""
                const size_t base = ((size_t)bh * RCAP + (t - n)) * D + gl * PER;
""", "tail_keys + base", "tail_values + base")
_APPEND_ROW = ("""
                const bool old = t - n < R - 1;
                const size_t base = (old ? ((size_t)bh * RCAP + (t - n)) * D : (size_t)bh * D) + gl * PER;
""", "(old ? tail_keys : new_keys) + base", "(old ? tail_values : new_values) + base")


def _tail_load(appending: bool, load: str) -> str:
    """The tail's loads, ``load`` a statement with ``{K}`` and ``{V}`` for the row pointers."""
    find, k, v = _APPEND_ROW if appending else _TAIL_ROW
    return find + "                " + load.replace("{K}", k).replace("{V}", v) + "\n"


# One pass's loads for the pipelined loop: positions T0 + u * GROUPS + group into DST, then the
# table's slots for the pass after it (their load overlaps this pass's scoring).
_FETCH = """
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int t = T0 + u * GROUPS + group;
        if (t >= tend) {
            DST[u].zero();
        } else if (t < n) {
            const size_t base = ((size_t)slot[u] * HKV + h) * D + gl * PER;
            DST[u].load(keys + base, values + base);
        } else {
{TAIL_LOAD}        }
    }
#pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
        const int t = T0 + STRIDE + u * GROUPS + group;
        slot[u] = t < pool_end ? trow[t] : 0;
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


def loop_source(loop: str, appending: bool) -> str:
    """The main loop's source, reading the tail (``tail_keys`` ...) or appending to it."""
    fetch = _FETCH.replace("{TAIL_LOAD}", _tail_load(appending, "DST[u].load({K}, {V});"))
    if loop == "classic":
        tail = _tail_load(appending, "load_row<T, PER>({K}, kr[u]);\n                load_row<T, PER>({V}, vr[u]);")
        return _CLASSIC_LOOP.replace("{LOOP_START}", _LOOP_START).replace("{TAIL_LOAD}", tail)
    if loop == "pipelined":
        return (_PIPELINED_LOOP.replace("{LOOP_START}", _LOOP_START)
                .replace("{FETCH_FIRST}", fetch.replace("T0", "tfirst").replace("DST", "cur"))
                .replace("{FETCH_NEXT}", fetch.replace("T0", "(t0 + STRIDE)").replace("DST", "nxt"))
                .replace("{COMPUTE}", _PASS.replace("CUR", "cur").replace("T0", "t0")))
    if loop == "mma":
        row = _MMA_ROW[appending]
        return (_MMA_LOOP.replace("{V_ROW}", row.replace("{KV}", "values"))
                .replace("{K_ROW}", row.replace("{KV}", "keys")))
    raise ValueError(f"unknown paged kernel loop {loop!r}")
