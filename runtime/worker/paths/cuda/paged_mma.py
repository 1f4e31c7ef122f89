"""CUDA sources of the paged decode kernel's tensor-core loops (``mma``, ``mma_ahead``).

The loop (sm_80 and later, 2-byte K/V, head dims of 16s, up to 8 query heads per KV head)
takes 16 positions a warp at a time, every K/V element read once, straight from the pool into
registers by 16-byte loads (no shared memory):

* scores S = Q K^T as two m16n8k16 tiles (rows: the GQA group's query heads, 8 of 16 used
  at most; columns: 8 positions each). The k axis (head dims) is permuted the same way for Q
  and K, so a lane's B fragments of K are whole 16-byte pieces of its position's row;
* the output as O^T = V^T P^T (rows: 16 head dims a tile, columns: the 8 query heads): the
  score tiles' C registers are P^T's B fragment as they lie, and V^T's A fragments are pairs
  of positions at one dim, made from two rows' words by ``__byte_perm``. The output's dims are
  permuted too (``vdim``) so that each lane's V loads are whole 16-byte pieces.

P is rounded to the K/V dtype for its product, as cuDNN's and FlashAttention's are. The
session-19 loop of the same name (K by 4-byte loads, V through a shared-memory tile and
``ldmatrix.trans``) was correct on an H200 but 1.8x slower than ``pipelined`` (168 against
95 us at 1 x 32k). Loops that copied a warp's passes into 2-6 shared-memory stages by
``cp.async`` (no register buffer for the passes in flight: 167-181 registers a lane against
mma_ahead's 255) were correct on an H100 in session 28 but slower at every launch tried: 84.7-89.5
against 74.0 us at 1 x 32k with scattered slots, 437-450 against 370 at 8 x 32k, 231 against 197
(mma) at 64 x 2k (``docs/runs/h100-s28-w3-kernel-staged.log``). So were loops that asked the L2 for the pool rows of the
pass 4-12 passes ahead (``prefetch.L2``, no registers held): correct, bit for bit the loops'
own results, and slower everywhere on an H100 in session 37: 81-91 against 65 us at 1 x 32k, 569-643
against 366 at 8 x 32k, 293-306 against 201 at 64 x 2k (``docs/runs/h100-s37-w1-kernel-l2.log``).
Its device helpers are in ``tensor_core``; ``tests/cuda_sim.py`` emulates
``mma.sync`` with the PTX ISA's fragment layouts, and the warp intrinsics.
"""

from __future__ import annotations

# Position t's K or V row (``{KV}``: keys or values) for the mma loop: the pool's slot, or the
# tail (appending: the old tail's first R - 1 positions, then this step's K/V).
_MMA_ROW = {
    False: "(t < n ? {KV} + ((size_t)trow[t] * HKV + h) * D : tail_{KV} + ((size_t)bh * RCAP + (t - n)) * D)",
    True: "(t < n ? {KV} + ((size_t)trow[t] * HKV + h) * D : t - n < R - 1 ? tail_{KV} + ((size_t)bh * RCAP + (t - n)) * D"
          " : new_{KV}_row)",
}

_MMA_PROLOGUE = """
    static_assert(D % 16 == 0 && NREP <= 8, "the mma loop takes head dims of 16s and at most 8 query heads");
    constexpr int KS = D / 16;  // k-steps of the score product
    constexpr int KW = D / 8;  // words of a K (and Q) row a lane holds: two a k-step
    constexpr int MT = D / 16;  // m-tiles (16 dims) of the output; a lane holds word mt of a V row for tile mt
    constexpr int CK = KW % 4 == 0 ? 4 : KW % 2 == 0 ? 2 : 1;  // words per K load
    constexpr int CV = MT % 4 == 0 ? 4 : MT % 2 == 0 ? 2 : 1;  // words per V load
    constexpr int STRIDE = NWARPS * 16;
    const int g = lane / 4;  // fragment row / column group
    const int q4 = lane % 4;
    // A lane's K / Q word w holds dims kdim(w), +1 (lanes q4 = 0..3 side by side in each load);
    // its V word mt holds dims vdim(mt), +1 (lanes g = 0..7 side by side), output tile mt's rows g, g + 8.
#define KDIM(w) (((w) / CK) * 8 * CK + q4 * 2 * CK + 2 * ((w) % CK))
#define VDIM(w) (((w) / CV) * 16 * CV + g * 2 * CV + 2 * ((w) % CV))
    const bool aligned = ((reinterpret_cast<size_t>(keys) | reinterpret_cast<size_t>(values) |
                           reinterpret_cast<size_t>(tail_keys) | reinterpret_cast<size_t>(tail_values){NEW_PTRS}) & 15) == 0;
    unsigned qa[KW];  // Q's A fragments, row (query head) g
    {
        const T* qrow = qblock + (size_t)(g < NREP ? g : 0) * D;
#pragma unroll
        for (int w = 0; w < KW; ++w) qa[w] = g < NREP ? raw2(qrow[KDIM(w)], qrow[KDIM(w) + 1]) : 0u;
    }
    const float sc2 = sc * 1.4426950408889634f;  // scores in log2 units: exp2f is the cheaper exponential
    float om = -INFINITY;  // head g's running max (log2 units) and sum
    float ol = 0.f;
    float oacc[MT][4];  // O^T's C fragments: dims vdim(mt) ([0], [1]) and vdim(mt) + 1 ([2], [3]) of heads 2 q4 and 2 q4 + 1
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) oacc[mt][0] = oacc[mt][1] = oacc[mt][2] = oacc[mt][3] = 0.f;
    const T* kpad = keys + (size_t)h * D;  // positions past the end read slot 0 (finite), weighted 0
    const T* vpad = values + (size_t)h * D;
    const int pool_end = min(n, tend);  // a pass below it reads the pool only (most passes: a short path)
"""

# One pass's loads: the K rows of positions T0 + g and T0 + 8 + g into KW_[2][KW], the V rows of
# positions T0 + 2 q4, + 1, T0 + 8 + 2 q4, + 1 into VW_[4][MT]. {K_T} / {V_T}: the row's
# position t, where its address needs it (not on the short path: a row by its slot alone).
_MMA_LOAD = """
#pragma unroll
        for (int j = 0; j < 2; ++j) {
{K_T}            const T* krow = {K_ROW};
#pragma unroll
            for (int i = 0; i < KW / CK; ++i) load_chunk<CK>(krow + KDIM(i * CK), &KW_[j][i * CK], ALIGNED);
        }
#pragma unroll
        for (int p = 0; p < 4; ++p) {
{V_T}            const T* vrow = {V_ROW};
#pragma unroll
            for (int i = 0; i < MT / CV; ++i) load_chunk<CV>(vrow + VDIM(i * CV), &VW_[p][i * CV], ALIGNED);
        }
"""

# One pass's scores, online softmax and output update, from KW_ / VW_ loaded for T0.
_MMA_COMPUTE = """
        float st[2][4];  // score tiles: row g, positions T0 + j * 8 + 2 * q4 (+1)
#pragma unroll
        for (int j = 0; j < 2; ++j) {
            st[j][0] = st[j][1] = st[j][2] = st[j][3] = 0.f;
#pragma unroll
            for (int ks = 0; ks < KS; ++ks) {
                const unsigned a[4] = {qa[2 * ks], 0u, qa[2 * ks + 1], 0u};
                mma16816(st[j], a, &KW_[j][2 * ks], (const T*)nullptr);
            }
        }
        float sv[4];
        float mx = -INFINITY;
#pragma unroll
        for (int e = 0; e < 4; ++e) {
            const int t = T0 + (e / 2) * 8 + 2 * q4 + (e % 2);
            sv[e] = t < tend ? st[e / 2][e % 2] * sc2 : -INFINITY;
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
            pv[e] = mn == -INFINITY ? 0.f : exp2f(sv[e] - mn);
            ps += pv[e];
        }
        if (mn != -INFINITY) corr = exp2f(om - mn);
        ps += __shfl_xor_sync(0xffffffff, ps, 1);
        ps += __shfl_xor_sync(0xffffffff, ps, 2);
        ol = ol * corr + ps;
        om = mn;
        // P^T's B fragment (rows: positions 2 q4, + 1 and 8 + 2 q4, + 1; column: head g).
        const unsigned pb[2] = {pack2(pv[0], pv[1], (const T*)nullptr), pack2(pv[2], pv[3], (const T*)nullptr)};
        const float c0 = __shfl_sync(0xffffffff, corr, 8 * q4);  // the rescale of head 2 q4 (lanes of group 2 q4)
        const float c1 = __shfl_sync(0xffffffff, corr, 8 * q4 + 4);  // and of head 2 q4 + 1
        if (__any_sync(0xffffffff, corr != 1.f)) {  // most passes leave every head's max as it was
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                oacc[mt][0] *= c0;
                oacc[mt][2] *= c0;
                oacc[mt][1] *= c1;
                oacc[mt][3] *= c1;
            }
        }
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
            // V^T's A fragment: rows vdim(mt) (low halves) and + 1 (high halves), columns the positions
            const unsigned va[4] = {__byte_perm(VW_[0][mt], VW_[1][mt], 0x5410), __byte_perm(VW_[0][mt], VW_[1][mt], 0x7632),
                                    __byte_perm(VW_[2][mt], VW_[3][mt], 0x5410), __byte_perm(VW_[2][mt], VW_[3][mt], 0x7632)};
            mma16816(oacc[mt], va, pb, (const T*)nullptr);
        }
"""

# A pool pass's slots (its K rows' into SK_[2], its V rows' into SV_[4]), loaded a pass ahead
# so a pass's K/V loads do not wait for its table reads.
_MMA_SLOTS = """
        if (T0 + 16 <= pool_end) {
#pragma unroll
            for (int j = 0; j < 2; ++j) SK_[j] = trow[T0 + j * 8 + g];
#pragma unroll
            for (int p = 0; p < 4; ++p) SV_[p] = trow[T0 + (p / 2) * 8 + 2 * q4 + p % 2];
        }
"""

# mma: a pass loaded (its slots were read during the pass before), then computed.
_MMA_LOOP = """
    int sk[2], sv[4];
{SLOTS_FIRST}    for (int t0 = tbegin + warp * 16; t0 < tend; t0 += STRIDE) {
        unsigned kw[2][KW];
        unsigned vw[4][MT];
{LOAD_T0}{SLOTS_NEXT}{COMPUTE_T0}    }
"""

# mma_ahead: the next pass's loads issued before this pass is computed, two register buffers
# (and slot sets) taken in turn, no copy between them.
_MMA_AHEAD_LOOP = """
    unsigned kw[2][KW], vw[4][MT], kn[2][KW], vn[4][MT];
    int sk[2], sv[4], skn[2], svn[4];
    int t0 = tbegin + warp * 16;
{SLOTS_A_T0}    if (t0 < tend) {
{LOAD_A_T0}    }
{SLOTS_B_T1}    while (t0 < tend) {
        const int t1 = t0 + STRIDE;
        const int t2 = t1 + STRIDE;
        if (t1 < tend) {
{LOAD_B_T1}        }
{SLOTS_A_T2}{COMPUTE_A_T0}        if (t1 >= tend) break;
        if (t2 < tend) {
{LOAD_A_T2}        }
{SLOTS_B_T3}{COMPUTE_B_T1}        t0 = t2;
    }
"""

# The mma loop's results into the block merge's shared memory (``paged_kernels.WARP_SHARED``).
MMA_WARP_OUT = """    if (q4 == 0 && g < NREP) {
        sm_m[warp][g] = om * 0.6931471805599453f;  // natural units, as the block merge takes them
        sm_l[warp][g] = ol;
    }
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        if (2 * q4 + r < NREP) {
#pragma unroll
            for (int mt = 0; mt < MT; ++mt) {
                sm_acc[warp][2 * q4 + r][VDIM(mt)] = oacc[mt][r];
                sm_acc[warp][2 * q4 + r][VDIM(mt) + 1] = oacc[mt][2 + r];
            }
        }
    }
#undef KDIM
#undef VDIM
"""


MMA_LOOPS = ("mma", "mma_ahead")


def mma_loop_source(appending: bool, loop: str = "mma") -> str:
    """The ``mma`` or ``mma_ahead`` loop's source, reading the tail or (``appending``) the old
    tail and this step's K/V.

    The loop is written twice, for 16-byte aligned buffers (the usual case: whole 16-byte
    loads) and for others (element loads), so no load carries a run-time alignment test; and
    each pass's loads take a short path where the whole pass lies in the pool (a row's
    address from the slot table only) and the full selection (pool, tail, this step's K/V,
    past the end) otherwise.
    """
    row = _MMA_ROW[appending]
    new = " | reinterpret_cast<size_t>(new_keys_row) | reinterpret_cast<size_t>(new_values_row)" if appending else ""
    general = (_MMA_LOAD.replace("{K_T}", "            const int t = T0 + j * 8 + g;\n")
               .replace("{V_T}", "            const int t = T0 + (p / 2) * 8 + 2 * q4 + p % 2;\n")
               .replace("{K_ROW}", f"t < tend ? {row} : kpad".replace("{KV}", "keys"))
               .replace("{V_ROW}", f"t < tend ? {row} : vpad".replace("{KV}", "values")))
    short = (_MMA_LOAD.replace("{K_T}", "").replace("{V_T}", "")
             .replace("{K_ROW}", "keys + ((size_t)SK_[j] * HKV + h) * D")
             .replace("{V_ROW}", "values + ((size_t)SV_[p] * HKV + h) * D"))

    def loads(k: str, v: str, t0: str, aligned: str, slots: tuple[str, str]) -> str:
        both = f"        if (T0 + 16 <= pool_end) {{\n{short}        }} else {{\n{general}        }}\n"
        return (both.replace("KW_", k).replace("VW_", v).replace("T0", t0).replace("ALIGNED", aligned)
                .replace("SK_", slots[0]).replace("SV_", slots[1]))

    def slots_for(t0: str, slots: tuple[str, str]) -> str:
        return _MMA_SLOTS.replace("T0", t0).replace("SK_", slots[0]).replace("SV_", slots[1])

    def computes(k: str, v: str, t0: str) -> str:  # a block of its own: mma_ahead has two
        return "        {\n" + _MMA_COMPUTE.replace("KW_", k).replace("VW_", v).replace("T0", t0) + "        }\n"

    a, b = ("sk", "sv"), ("skn", "svn")

    def loop_text(aligned: str) -> str:
        if loop == "mma":
            parts = {"{SLOTS_FIRST}": slots_for("(tbegin + warp * 16)", a), "{LOAD_T0}": loads("kw", "vw", "t0", aligned, a),
                     "{SLOTS_NEXT}": slots_for("(t0 + STRIDE)", a), "{COMPUTE_T0}": computes("kw", "vw", "t0")}
            source = _MMA_LOOP
        elif loop == "mma_ahead":
            parts = {"{SLOTS_A_T0}": slots_for("t0", a), "{LOAD_A_T0}": loads("kw", "vw", "t0", aligned, a),
                     "{SLOTS_B_T1}": slots_for("(t0 + STRIDE)", b), "{LOAD_B_T1}": loads("kn", "vn", "t1", aligned, b),
                     "{SLOTS_A_T2}": slots_for("t2", a), "{LOAD_A_T2}": loads("kw", "vw", "t2", aligned, a),
                     "{SLOTS_B_T3}": slots_for("(t2 + STRIDE)", b), "{COMPUTE_A_T0}": computes("kw", "vw", "t0"),
                     "{COMPUTE_B_T1}": computes("kn", "vn", "t1")}
            source = _MMA_AHEAD_LOOP
        else:
            raise ValueError(f"unknown mma loop {loop!r}")
        for marker, text in parts.items():
            source = source.replace(marker, text)
        return source

    return (_MMA_PROLOGUE.replace("{NEW_PTRS}", new) + "    if (aligned) {\n" + loop_text("true")
            + "    } else {\n" + loop_text("false") + "    }\n")
