"""GPU time of the paged decode kernel against MLX's fused SDPA on contiguous K/V (CUDA only).

Each call is evaluated on its own; kernel durations come from CUPTI (``kernel_trace``), so
host overhead is not in the numbers. ``--variant`` edits the classic loop's source to take
one stage out (time by difference), ``--launch`` forces (splits, warps).

    python3 scripts/kernel_bench.py --rows 1,16,64 --context 300 --slots 131072
"""

from __future__ import annotations

import argparse
import re
import statistics

import kernel_trace
import mlx.core as mx
import numpy as np

from runtime.worker.paths.cuda import paged_loops
from runtime.worker.paths.cuda.kernel_launch import launch_shape
from runtime.worker.paths.paged_attention import PagedAttention

VARIANTS = {
    # the slot of position t is computed, not read from the table: no dependent load
    "notable": ("trow[t]", "(1 + b * n + t)"),
    # no K/V loads at all: what is left is the kernel's fixed cost
    "noload": ("load_row<T, PER>(keys + base, kr[u]);\n                load_row<T, PER>(values + base, vr[u]);",
               "for (int i = 0; i < PER; ++i) kr[u][i] = vr[u][i] = 1e-9f * base;"),
}


# A pool row's address in the mma loops: slot-major (slots, KV heads, D), the pool's layout.
_ROW_ADDRESS = re.compile(r"\(\(size_t\)(\w+\[\w+\]) \* HKV \+ h\) \* D")


def head_major(source: str) -> str:
    """The mma loops reading the pool as (KV heads, slots, D): one head's rows of consecutive
    slots side by side, as cuDNN reads contiguous K/V (timing only: the bench's pool is random)."""
    edited, count = _ROW_ADDRESS.subn(r"((size_t)h * keys_shape[0] + \1) * D", source)
    assert count >= 2, "no pool row address found to edit"
    return edited


def per_call(fn, calls: int, trace: bool = True) -> dict[str, float]:
    """Median GPU us per call of each kernel ``fn`` launches."""
    for _ in range(3):
        mx.eval(fn())
    if not trace:
        for _ in range(calls):
            mx.eval(fn())
        return {}
    report: dict = {}
    with kernel_trace.traced(report):
        for _ in range(calls):
            mx.eval(fn())
    by_name: dict[str, list[float]] = {}
    for name, _, dur in report["kernels"]:
        by_name.setdefault(name.split("(")[0][-60:], []).append(dur)
    return {name: statistics.median(d) * len(d) / calls for name, d in by_name.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--rows", default="1,16,64")
    p.add_argument("--context", type=int, default=300)
    p.add_argument("--tail", type=int, default=8, help="positions already in the decode tail")
    p.add_argument("--slots", type=int, default=0, help="pool slots (0: just enough)")
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    p.add_argument("--launch", default="", help="splits,warps instead of launch_shape's")
    p.add_argument("--calls", type=int, default=50)
    p.add_argument("--sweep", default="", help="splits x warps to try, e.g. 1,2,4,8x4,8 (appending kernel only)")
    p.add_argument("--variant", default="", choices=["", *VARIANTS])
    p.add_argument("--scatter", action="store_true", help="each row's slots at random places in the pool")
    p.add_argument("--loop", default="", help="the kernel's loop for every launch (default: the worker's, "
                                              "paged_attention.LOOP and SPLIT_LOOP)")
    p.add_argument("--no-trace", action="store_true", help="no CUPTI (under ncu)")
    p.add_argument("--head-major", action="store_true",
                   help="the mma loops read the pool as (KV heads, slots, D) (timing only)")
    p.add_argument("--split-registers", type=int, default=None,
                   help="the split kernels' register cap (default: the worker's, SPLIT_MAX_REGISTERS; 0 none)")
    args = p.parse_args()
    if args.head_major:
        slot_major = paged_loops.mma_loop_source
        paged_loops.mma_loop_source = lambda *a, **k: head_major(slot_major(*a, **k))
    if args.variant:
        old, new = VARIANTS[args.variant]
        assert old in paged_loops._CLASSIC_LOOP
        paged_loops._CLASSIC_LOOP = paged_loops._CLASSIC_LOOP.replace(old, new)
    n_q, n_kv, d = (int(x) for x in args.heads.split(","))
    dtype = mx.bfloat16
    attn = PagedAttention(True, loop="classic" if args.variant else args.loop or None,
                          split_registers=args.split_registers)
    print(f"loop {args.loop or 'default'}, split kernels' register cap {attn.split_registers}"
          f"{', pool read head-major' if args.head_major else ''}{', scattered slots' if args.scatter else ''}", flush=True)
    for b in [int(r) for r in args.rows.split(",")]:
        n = args.context - args.tail - 1  # pool positions
        slots = max(args.slots, b * args.context + 8)
        keys = mx.random.normal((slots, n_kv, d)).astype(dtype)
        values = mx.random.normal((slots, n_kv, d)).astype(dtype)
        perm = (np.random.default_rng(0).permutation(slots - 1)[: b * n] if args.scatter else np.arange(b * n)) + 1
        table = mx.array(perm.reshape(b, n).astype(np.int32))
        rows = mx.arange(b, dtype=mx.int32)
        lengths = mx.full((b,), args.context, dtype=mx.int32)
        tail_k = mx.random.normal((b, n_kv, args.tail + 1, d)).astype(dtype)  # room for the appended row
        tail_v = mx.random.normal((b, n_kv, args.tail + 1, d)).astype(dtype)
        new_k = mx.random.normal((b, n_kv, 1, d)).astype(dtype)
        new_v = mx.random.normal((b, n_kv, 1, d)).astype(dtype)
        q = mx.random.normal((b, n_q, 1, d)).astype(dtype)
        ck = mx.random.normal((b, n_kv, args.context, d)).astype(dtype)
        cv = mx.random.normal((b, n_kv, args.context, d)).astype(dtype)
        mx.eval(keys, values, table, tail_k, tail_v, new_k, new_v, q, ck, cv)
        # ``args.tail`` positions in the tail: read them, or append one more.
        full_len = old_len = mx.array([args.tail], dtype=mx.int32)
        launch = tuple(int(x) for x in args.launch.split(",")) if args.launch else \
            launch_shape(b, n_kv, n_q // n_kv, d, args.context)
        if args.sweep:
            splits_list, warps_list = ([int(x) for x in part.split(",")] for part in args.sweep.split("x"))
            cells = []
            for sp in splits_list:
                for w in warps_list:
                    times = per_call(lambda: attn.attend_appending(q, keys, values, table, rows, lengths, tail_k,
                                                                   tail_v, old_len, new_k, new_v, d**-0.5, (sp, w)),
                                     args.calls)
                    cells.append(f"{sp}x{w} {sum(times.values()):6.1f}")
            print(f"rows {b:4d} ctx {args.context} default {launch}: " + "  ".join(cells), flush=True)
            continue
        runs = {
            f"paged {launch}": lambda: attn.attend_appending(q, keys, values, table, rows, lengths, tail_k, tail_v,
                                                             old_len, new_k, new_v, d**-0.5, launch),
            f"paged read {launch}": lambda: attn._kernel_attend(q, keys, values, table, rows, lengths - 1, tail_k, tail_v,
                                                                full_len, d**-0.5, launch),
            "mx sdpa": lambda: mx.fast.scaled_dot_product_attention(q, ck, cv, scale=d**-0.5),
        }
        for label, fn in runs.items():
            times = per_call(fn, args.calls, not args.no_trace)
            detail = "  ".join(f"{v:6.1f} {k}" for k, v in times.items())
            print(f"rows {b:4d} ctx {args.context} slots {slots}: {label:16s} total {sum(times.values()):7.1f} us"
                  f"   [{detail}]", flush=True)


if __name__ == "__main__":
    main()
