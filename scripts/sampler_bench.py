"""Time the worker's sampler alone on a decode batch's logits: greedy, the full sampling set, compiled or not.

    python scripts/sampler_bench.py --rows 64 --vocab 128256 [--dtype bfloat16]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx

from runtime.protocol.worker import DecodeBatch, RowSampling
from runtime.worker.sampler import RowSampler

CASES = {
    "greedy": {},
    "temperature": dict(temperature=0.8),
    "top_k+top_p": dict(temperature=0.8, top_p=0.95, top_k=50),
    "+frequency": dict(temperature=0.8, top_p=0.95, top_k=50, frequency_penalty=0.5),
    "+logprobs 5": dict(temperature=0.8, top_p=0.95, top_k=50, frequency_penalty=0.5, logprobs=True, top_logprobs=5),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    rows = args.rows
    logits = mx.random.normal((rows, args.vocab)).astype(getattr(mx, args.dtype))
    mx.eval(logits)
    print(f"device {mx.default_device()}, {rows} rows, vocab {args.vocab}, {args.dtype}")
    for compiled in (False, True):
        for name, spec in CASES.items():
            sampler = RowSampler(rows, compiled=compiled)
            sampler.configure([RowSampling(row=r, seed=r, **spec) for r in range(rows)])
            decode = DecodeBatch(rows=list(range(rows)), token_ids=[-1] * rows, positions=list(range(rows)),
                                 slot_ids=[0] * rows, temperatures=[spec.get("temperature", 0.0)] * rows)
            for _ in range(5):
                mx.eval(sampler.sample(logits, decode).arrays())
            best = float("inf")
            for _ in range(3):
                start = time.perf_counter()
                for _ in range(args.steps):
                    decode.positions = [p + 1 for p in decode.positions]
                    mx.eval(sampler.sample(logits, decode).arrays())
                best = min(best, (time.perf_counter() - start) / args.steps)
            print(f"{'compiled' if compiled else 'eager':9s} {name:14s} {1e3 * best:7.3f} ms per step")


if __name__ == "__main__":
    main()
