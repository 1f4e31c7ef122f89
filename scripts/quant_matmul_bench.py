"""Many-row 4-bit matmul: MLX's quantized_matmul against dequantize-then-matmul, speed and bits.

    python scripts/quant_matmul_bench.py [--rows 1,16,64,128,256] [--shape 4096x14336]

For each row count: the time of ``mx.quantized_matmul`` (what mlx-lm's QuantizedLinear runs),
of a bf16 matmul over weights dequantized once (what a "dequantize for big batches" path
would run), and whether the two give the same bits. A path that changes the bits would make
our greedy tokens differ from mlx-lm's on the same quantized model, so it is only an option
if they match.
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx


def _time(fn, steps: int) -> float:
    mx.eval(fn())
    start = time.perf_counter()
    for _ in range(steps):
        mx.eval(fn())
    return (time.perf_counter() - start) / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="1,16,64,128,256")
    parser.add_argument("--shape", default="4096x14336", help="IN x OUT of the projection")
    parser.add_argument("--bits", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=64)
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    d_in, d_out = (int(v) for v in args.shape.split("x"))
    mx.random.seed(0)
    weight = (mx.random.normal((d_out, d_in)) * 0.02).astype(mx.bfloat16)
    wq, scales, biases = mx.quantize(weight, group_size=args.group_size, bits=args.bits)

    def dequantized() -> mx.array:
        return mx.dequantize(wq, scales, biases, group_size=args.group_size, bits=args.bits).astype(mx.bfloat16)

    dense = dequantized()
    mx.eval(wq, scales, biases, dense)
    print(f"device {mx.default_device()}, weight {d_in}x{d_out}, {args.bits}-bit, group {args.group_size}")
    tdq = _time(dequantized, args.steps)
    print(f"dequantizing the weight once (bf16 out): {tdq * 1e6:.1f} us")
    print("| rows | quantized_matmul us | dequantized bf16 matmul us | speed-up | same bits | max abs diff |")
    print("|---:|---:|---:|---:|---|---:|")
    for rows in (int(r) for r in args.rows.split(",")):
        x = (mx.random.normal((rows, d_in))).astype(mx.bfloat16)
        mx.eval(x)

        def quant(x=x):
            return mx.quantized_matmul(x, wq, scales, biases, transpose=True, group_size=args.group_size,
                                       bits=args.bits)

        def deq(x=x):
            return x @ dense.T

        tq, td = _time(quant, args.steps), _time(deq, args.steps)
        a, b = quant(), deq()
        same = bool(mx.array_equal(a, b).item())
        diff = float(mx.max(mx.abs(a.astype(mx.float32) - b.astype(mx.float32))).item())
        print(f"| {rows} | {tq * 1e6:.1f} | {td * 1e6:.1f} | {tq / td:.2f}x | {same} | {diff:.3g} |", flush=True)


if __name__ == "__main__":
    main()
