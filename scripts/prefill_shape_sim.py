"""Which prefill forward shapes the mixed workload meets that the start-up warm-up does not run,
simulated without MLX: the bench's schedule (``runtime/bench/mixed.py``) through the real
scheduler, each step's chunks grouped as the worker groups them (``prefill_groups``) and shaped as
it pads them (``Engine._prefill_inputs``, ``AttentionPaths.prefill_batch``), against the shapes of
``prefill_warmup.common_shapes``. On a GPU each such new shape builds kernels the first time.

Step times are modelled (``--decode-ms``, ``--prefill-ms``), so arrivals join steps about as
they would; greedy replies run to ``max_tokens``.

    python scripts/prefill_shape_sim.py --hybrid --rate 10 --requests 150 --prefix-requests 32
"""

from __future__ import annotations

import argparse
import random
import sys
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.mixed import MixedShape, schedule  # noqa: E402
from runtime.scheduler.admission import Limits  # noqa: E402
from runtime.scheduler.core import Scheduler  # noqa: E402
from runtime.scheduler.request import Request, SamplingParams  # noqa: E402
from runtime.worker.paths.prefill_groups import prefill_groups  # noqa: E402
from runtime.worker.paths.prefill_shapes import continuation_length, key_length, padded_rows, prefill_length  # noqa: E402
from runtime.worker.paths.prefill_warmup import common_shapes  # noqa: E402


def shape(group, max_context: int) -> tuple[int, int, int]:
    """(rows, queries, keys) of one padded prefill forward, as the worker records it."""
    start = max(c.start for c in group)
    n = max(len(c.token_ids) for c in group)
    n = min((continuation_length if start else prefill_length)(n), max_context - start)
    rows = padded_rows(len(group))
    keys = key_length(start, n, max_context) if start else n
    return rows, n, max(keys, start + n)


def simulate(args, mixed: bool) -> tuple[Counter, int, int, Counter]:
    rng = random.Random(args.seed)
    draws = schedule(rng, MixedShape(requests=args.requests, rate=args.rate, prefix_requests=args.prefix_requests))
    prefix = [rng.randrange(3, 30000) for _ in range(2000)]
    limits = Limits(num_slots=1 << 20, max_rows=args.max_rows, max_context=args.max_context, vocab_size=32000,
                    max_step_tokens=args.max_step_tokens, prefill_chunk=args.prefill_chunk,
                    aux_slots=4 * args.max_rows if args.hybrid else 0)
    s = Scheduler(limits, frozenset({0}))
    pending = sorted(draws, key=lambda d: d.at)
    shapes: Counter = Counter()
    clock, steps, forwards = 0.0, 0, 0
    tokens: Counter = Counter()  # prefill tokens: real, and as the padded forwards compute them
    queue = list(enumerate(pending))
    while queue or s.running or s.waiting:
        while queue and queue[0][1].at <= clock:
            i, d = queue.pop(0)
            own = [rng.randrange(3, 30000) for _ in range(d.prompt_len - (2000 if d.wave == "prefix" else 0))]
            ids = (prefix if d.wave == "prefix" else []) + own
            s.add(Request(rid=f"r{i}", prompt_ids=ids, params=SamplingParams(max_tokens=d.max_tokens, ignore_eos=True),
                          max_new=d.max_tokens))
        p = s.next_step()
        if p is None:
            clock = queue[0][1].at if queue else clock
            continue
        groups = prefill_groups(p.step.prefills, True, 0.25, recurrent=args.hybrid, pads_recurrent=args.hybrid,
                                mixed_starts=mixed and args.hybrid)
        for group in groups:
            if group[0].token_ids:
                rows, n, _ = shape(group, args.max_context)
                shapes[(rows, n, _)] += 1
                forwards += 1
                tokens["real"] += sum(len(c.token_ids) for c in group)
                tokens["computed"] += rows * n
                tokens["padding rows"] += (rows - len(group)) * n
        steps += 1
        clock += (args.prefill_ms if p.step.prefills else args.decode_ms) / 1000
        s.on_step_done(p.step.step_id, [7] * len(p.decode_reqs))
        s.pop_completed()
    return shapes, steps, forwards, tokens


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--hybrid", action="store_true", help="a recurrent model that pads its prompts (Qwen3-Next)")
    p.add_argument("--rate", type=float, default=10.0)
    p.add_argument("--requests", type=int, default=150)
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--max-rows", type=int, default=256)
    p.add_argument("--max-context", type=int, default=4096)
    p.add_argument("--max-step-tokens", type=int, default=2048)
    p.add_argument("--prefill-chunk", type=int, default=512)
    p.add_argument("--decode-ms", type=float, default=17.0)
    p.add_argument("--prefill-ms", type=float, default=100.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--show", type=int, default=12, help="the most frequent new shapes to list")
    args = p.parse_args()
    warm = {(r, n, start + n) for r, n, start in common_shapes(args.max_step_tokens, args.prefill_chunk,
                                                                  args.max_rows, args.max_context)}
    total = args.requests + args.prefix_requests
    for mixed in ((False, True) if args.hybrid else (False,)):
        shapes, steps, forwards, tokens = simulate(args, mixed)
        new = {k: v for k, v in shapes.items() if k not in warm}
        print(f"{'mixed starts' if mixed else 'by start'}: {steps} steps, {forwards} prefill forwards, "
              f"{len(shapes)} shapes, {len(new)} not warmed ({1000 * len(new) / total:.0f} per 1,000 requests), "
              f"{sum(new.values())} forwards of them")
        print(f"  prefill tokens: {tokens['real']} real, {tokens['computed']} computed "
              f"({tokens['computed'] / max(1, tokens['real']):.2f}x; padding rows {tokens['padding rows']})")
        for (rows, n, keys), count in sorted(new.items(), key=lambda kv: -kv[1])[:args.show]:
            print(f"  rows {rows:3d} queries {n:5d} keys {keys:5d}: {count}")


if __name__ == "__main__":
    main()
