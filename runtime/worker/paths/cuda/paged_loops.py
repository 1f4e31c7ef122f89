"""CUDA sources of the paged decode kernel's main loop over positions (``paged_kernels.body``).

Each loop walks a block's positions in warp passes of ``GROUPS * UNROLL`` positions (a group
of GL lanes per position, see ``paged_kernels``) and leaves each lane's running max ``m``,
sum ``l`` and accumulator ``acc`` for the epilogue:

* ``classic``: a pass's K/V loaded, then scored, with a rescale per position;
* ``pipelined``: the next pass's loads issued before this pass is scored, one rescale per
  pass (10-17% faster than classic on an H200); its register copy of the prefetched pass at
  the end of each iteration waits for those loads, so it keeps about one pass in flight;
* ``mma``: tensor cores, 16 positions a warp at a time (``paged_mma``; it leaves its results
  in the block merge's shared memory itself); ``mma_ahead`` the same with the next pass's
  loads issued before this pass is computed.

Ring loops (N buffers taken in turn, unrolled, N - 1 passes ahead) were measured on an H200 in
session 19 and removed: no faster than ``pipelined`` at any size (ring3 at 1 x 32k: 161 against
151 us), ring4 could not launch 16 warps. So was a ``staged`` loop (each lane's K/V of the next
3 passes copied into shared memory with cp.async, no registers held): no faster at any size
(147 against 135 us at 1 x 32k). The kernel is bound by its instructions, not by memory latency.
"""

from __future__ import annotations

from runtime.worker.paths.cuda.paged_mma import MMA_LOOPS, mma_loop_source

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
                const size_t base = (old ? ((size_t)bh * RCAP + (t - n)) * D : 0) + gl * PER;
""", "(old ? tail_keys : new_keys_row) + base", "(old ? tail_values : new_values_row) + base")


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
    if loop in MMA_LOOPS:
        return mma_loop_source(appending, loop)
    raise ValueError(f"unknown paged kernel loop {loop!r}")
