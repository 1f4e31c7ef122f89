"""The paged decode kernel's loop variants against each other and MLX's fused SDPA (CUDA only).

Variants: ``classic`` (one warp pass of K/V in flight, a rescale per position) and
``pipelined`` (the next pass's loads in flight while a pass is scored, one rescale per pass),
each at ``--unroll`` positions per lane group and pass. Wall time of ``--calls`` chained
calls per evaluation (as a decode step chains its layers), per (rows, context) case at the
launch ``launch_shape`` chooses and at its splits with each of ``--warps`` (a loop with more
buffers may need fewer warps to launch, or run faster with them), and at ``--sweep`` (splits x
warps) for the first case.

    python3 scripts/paged_kernel_ab.py --cases 1x32768,1x4096,8x4096,64x512,256x512
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from runtime.worker.paths.cuda.kernel_launch import launch_shape
from runtime.worker.paths.paged_attention import PagedAttention


def case_arrays(rows: int, context: int, n_q: int, n_kv: int, d: int) -> dict:
    keys = mx.random.normal((rows * context + 8, n_kv, d)).astype(mx.bfloat16)
    values = mx.random.normal((rows * context + 8, n_kv, d)).astype(mx.bfloat16)
    perm = np.random.default_rng(0).permutation(rows * context) + 1  # slots scattered over the pool
    arrays = {
        "keys": keys, "values": values,
        "table": mx.array(perm.reshape(rows, context).astype(np.int32)),
        "rows": mx.arange(rows, dtype=mx.int32),
        "lengths": mx.full((rows,), context, dtype=mx.int32),
        "tail_k": mx.random.normal((rows, n_kv, 16, d)).astype(mx.bfloat16),
        "tail_v": mx.random.normal((rows, n_kv, 16, d)).astype(mx.bfloat16),
        "new_k": mx.random.normal((rows, n_kv, 1, d)).astype(mx.bfloat16),
        "new_v": mx.random.normal((rows, n_kv, 1, d)).astype(mx.bfloat16),
        "q": mx.random.normal((rows, n_q, 1, d)).astype(mx.bfloat16),
        "ck": mx.random.normal((rows, n_kv, context, d)).astype(mx.bfloat16),
        "cv": mx.random.normal((rows, n_kv, context, d)).astype(mx.bfloat16),
        "tail_len": mx.array([8], dtype=mx.int32),
    }
    mx.eval(*arrays.values())
    return arrays


def chained_us(fn, q: mx.array, calls: int) -> float:
    """Median over 3 repeats of the wall time per call of ``calls`` calls, each fed the last's output."""
    times = []
    for _ in range(4):
        x = q
        mx.eval(x)
        t0 = time.perf_counter()
        for _ in range(calls):
            x = fn(x)
        mx.eval(x)
        times.append(1e6 * (time.perf_counter() - t0) / calls)
    return float(np.median(times[1:]))


def agreement(variants: dict, a: dict, launch: tuple[int, int], d: int) -> str:
    """Max abs difference of each variant's output from gathered K/V through MLX's SDPA."""
    held = a["tail_len"].item()  # positions in the tail; the step's K/V come after them
    table = a["table"][:, : a["lengths"][0].item() - held - 1]
    keys = mx.concatenate([a["keys"][table].transpose(0, 2, 1, 3), a["tail_k"][:, :, :held], a["new_k"]], axis=2)
    values = mx.concatenate([a["values"][table].transpose(0, 2, 1, 3), a["tail_v"][:, :, :held], a["new_v"]],
                            axis=2)
    ref = mx.fast.scaled_dot_product_attention(a["q"], keys, values, scale=d**-0.5).astype(mx.float32)
    diffs = []
    for name, attn in variants.items():
        try:
            out, _, _ = attn.attend_appending(a["q"], a["keys"], a["values"], a["table"], a["rows"], a["lengths"],
                                              a["tail_k"], a["tail_v"], a["tail_len"], a["new_k"], a["new_v"],
                                              d**-0.5, launch)
            diffs.append(f"{name} {mx.abs(out.astype(mx.float32) - ref).max().item():.4f}")
        except Exception:
            diffs.append(f"{name} -")
    return "| max abs diff vs sdpa: " + " ".join(diffs)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--cases", default="1x32768,1x8192,1x2048,8x4096,64x512,64x2048,128x768,256x512")
    p.add_argument("--heads", default="32,8,128", help="query heads, KV heads, head dim")
    p.add_argument("--variants", default="classic:1,pipelined:1,mma:1,mma_ahead:1", help="loop:unroll, ...")
    p.add_argument("--sweep", default="32,64x4,8,16", help="splits x warps tried on the first case")
    p.add_argument("--warps", default="4,8,16", help="warps tried at every case's default splits")
    p.add_argument("--calls", type=int, default=32)
    args = p.parse_args()
    n_q, n_kv, d = (int(x) for x in args.heads.split(","))
    variants = {}
    for spec in args.variants.split(","):
        kind, unroll = spec.split(":")
        variants[spec] = PagedAttention(True, loop=kind, unroll=int(unroll))
    print(f"device {mx.default_device()}, heads {n_q}/{n_kv} dim {d}, us per call ({args.calls} chained)", flush=True)
    for index, case in enumerate(args.cases.split(",")):
        rows, context = (int(x) for x in case.split("x"))
        a = case_arrays(rows, context, n_q, n_kv, d)
        default = launch_shape(rows, n_kv, n_q // n_kv, d, context)
        launches = [default] + [(default[0], int(w)) for w in args.warps.split(",") if w and int(w) != default[1]]
        if index == 0 and args.sweep:
            splits_list, warps_list = ([int(x) for x in part.split(",")] for part in args.sweep.split("x"))
            launches += [(s, w) for s in splits_list for w in warps_list if (s, w) not in launches]
        sdpa = chained_us(lambda x: mx.fast.scaled_dot_product_attention(x, a["ck"], a["cv"], scale=d**-0.5),
                          a["q"], args.calls)
        gbytes = 2 * rows * context * n_kv * d * 2 / 1e9
        print(f"rows {rows:4d} context {context:6d}: mx.fast sdpa {sdpa:7.1f} us ({gbytes / sdpa * 1e3:.2f} TB/s)",
              flush=True)
        for launch in launches:
            cells = []
            for name, attn in variants.items():
                def step(x, attn=attn, launch=launch):
                    out, _, _ = attn.attend_appending(x, a["keys"], a["values"], a["table"], a["rows"], a["lengths"],
                                                      a["tail_k"], a["tail_v"], a["tail_len"], a["new_k"], a["new_v"],
                                                      d**-0.5, launch)
                    return out
                try:
                    us = chained_us(step, a["q"], args.calls)
                    cells.append(f"{name} {us:7.1f} ({gbytes / us * 1e3:.2f} TB/s)")
                except Exception as exc:  # a build failure of one variant must not hide the others
                    cells.append(f"{name} FAILED {str(exc)[:300]}")
            if launch == default:  # the variants' outputs against MLX's attention on the same positions
                cells.append(agreement(variants, a, launch, d))
            mark = " (default)" if launch == default else ""
            print(f"rows {rows:4d} context {context:6d} launch {launch}{mark}: " + "  ".join(cells), flush=True)
        mx.clear_cache()


if __name__ == "__main__":
    main()
