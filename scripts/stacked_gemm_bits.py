"""Whether one product over stacked weights gives the separate projections' bits, by row count.

``runtime/worker/model/fused_projections.py`` stacks q/k/v and gate/up weights and, for one
token, runs one matrix-vector product instead of three and two. Steps of many rows still run
each projection on its own: whether a matrix-matrix product over the stacked weights rounds
each output like the separate products depends on the kernel the backend picks for the shape.
This script answers it for the bench shapes on the current device, row count by row count,
and times both ways (microseconds per group, kernels included).

    python scripts/stacked_gemm_bits.py --shape llama-1b --rows 1,2,16,64,128,256
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from runtime.bench.models import shape_config


def groups(cfg: dict) -> dict[str, list[int]]:
    h, heads, kv = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = h // heads
    return {"qkv": [heads * d, kv * d, kv * d], "gate_up": [cfg["intermediate_size"]] * 2}


def timed(fn, reps: int) -> float:
    mx.eval(fn())
    start = time.perf_counter()
    for _ in range(reps):
        mx.eval(fn())
    return (time.perf_counter() - start) / reps * 1e6


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", default="llama-1b")
    ap.add_argument("--rows", default="1,2,16,64,128,256")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    cfg = shape_config(args.shape)
    dtype = {"bfloat16": mx.bfloat16, "float32": mx.float32}[cfg["torch_dtype"]]
    h = cfg["hidden_size"]
    print(f"device {mx.default_device()}, shape {args.shape}, {dtype}")
    print("| group | rows | same bits | separate us | stacked us |")
    print("|---|---:|---|---:|---:|")
    for name, widths in groups(cfg).items():
        mx.random.seed(0)
        ws = [(mx.random.normal((w, h)) / h**0.5).astype(dtype) for w in widths]
        stacked = mx.concatenate(ws, axis=0)
        mx.eval(ws, stacked)
        bounds = [sum(widths[:i]) for i in range(len(widths) + 1)]
        for rows in (int(r) for r in args.rows.split(",")):
            x = mx.random.normal((rows, h)).astype(dtype)
            mx.eval(x)
            separate = [x @ w.T for w in ws]
            whole = x @ stacked.T
            parts = [whole[:, bounds[i]:bounds[i + 1]] for i in range(len(ws))]
            same = all(mx.array_equal(a, b).item() for a, b in zip(separate, parts))
            t_sep = timed(lambda: [x @ w.T for w in ws], args.reps)
            t_stk = timed(lambda: x @ stacked.T, args.reps)
            print(f"| {name} | {rows} | {'yes' if same else 'NO'} | {t_sep:.1f} | {t_stk:.1f} |", flush=True)


if __name__ == "__main__":
    main()
