"""What a step's grammar masks cost the scheduler: ``rows`` constrained requests advancing together.

Builds the bench's byte-level tokenizer at the bench model's vocabulary (128,256 for the
llama-1b shape) and the structured workload's JSON schema, then, step after step, computes
every row's mask in one call (``MaskClock.masks``, as the scheduler does) and advances each row
with a random allowed token. No model and no device: the masks are the scheduler's CPU work.

    python scripts/mask_time.py --rows 32 --vocab 128256 --steps 200
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import numpy as np

from runtime.bench.tokenizers import write_byte_tokenizer
from runtime.bench.structured import SCHEMA
from runtime.scheduler.grammar import JSON_LAYOUT, Grammars, GrammarSpec, MaskClock
from runtime.scheduler.tokenizer import Tokenizer


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", type=int, default=32, help="constrained rows per step (half of 64 streams)")
    p.add_argument("--vocab", type=int, default=128256)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    from llguidance import LLMatcher

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        write_byte_tokenizer(folder, args.vocab)
        grammars = Grammars(Tokenizer(str(folder)), args.vocab)
        grammar = LLMatcher.grammar_from_json_schema(json.dumps({"x-guidance": JSON_LAYOUT} | SCHEMA))
        rows = [grammars.constraint(GrammarSpec("json_schema", grammar)) for _ in range(args.rows)]
        rng = np.random.default_rng(args.seed)
        clock, times = MaskClock(), []
        for _ in range(args.steps):
            before = clock.seconds
            masks = clock.masks(rows)
            times.append(1e3 * (clock.seconds - before))
            for row, mask in zip(rows, masks):
                bits = np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little")[: args.vocab]
                allowed = np.flatnonzero(bits)
                row.advance(int(rng.choice(allowed)))
    rest = sorted(times[1:])  # the first step builds the lexer
    print(f"{args.rows} rows, vocabulary {args.vocab}, {args.steps} steps: masks per step p50 "
          f"{statistics.median(rest):.3f} ms, p95 {rest[int(0.95 * len(rest))]:.3f} ms, max {max(times):.3f} ms; "
          f"per row p50 {1e3 * statistics.median(rest) / args.rows:.1f} us")


if __name__ == "__main__":
    main()
