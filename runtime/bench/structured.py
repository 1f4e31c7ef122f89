"""The ``structured`` workload: N streams, half of them JSON-schema constrained, against none.

Runtime only: it measures what structured output costs the batch. A constrained row needs its
last token before its next mask exists, so it takes every other step while the other rows stay
chained; the target is at least 0.7x the unconstrained throughput with half the rows
constrained. Unconstrained and half-constrained rounds alternate. The schema asks for a long
array, so constrained requests run to ``max_tokens`` like the others (``ignore_eos``). Each
constrained round also reports the scheduler's grammar-mask time per step that needed masks
(``runtime status``'s ``mask_s`` / ``mask_steps`` before and after the round).
"""

from __future__ import annotations

from typing import Any

from runtime.bench import runtime_side
from runtime.bench.measure import StreamTiming, percentile, ratio, summarize
from runtime.bench.report import table
from runtime.bench.workloads import WARMUP_GEN, Bench, Outcome

SCHEMA = {
    "type": "object",
    "properties": {"items": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1000}},
    "required": ["items"],
}


class Structured:
    """``streams`` concurrent requests, unconstrained and then half constrained, ``rounds`` times."""

    name = "structured"

    def __init__(self, bench: Bench, streams: int, prompt_len: int, gen_len: int, rounds: int = 3) -> None:
        self.bench, self.streams, self.prompt_len, self.gen_len, self.rounds = bench, streams, prompt_len, gen_len, rounds
        self.warm = bench.prompts(streams, prompt_len)
        self.timed = [bench.prompts(streams, prompt_len) for _ in range(2 * rounds)]
        self.half = [dict(json_schema=SCHEMA) if i % 2 == 0 else {} for i in range(streams)]
        self.free: list[list[StreamTiming]] = []
        self.mixed: list[list[StreamTiming]] = []
        self.mask_ms: list[float] = []  # per constrained round: mask time per step that had masks

    def run_runtime(self, addresses: dict[str, str], rep: int) -> None:
        n, address = self.streams, addresses["on"]
        self.bench.log(f"structured/runtime: warm-up, then {self.rounds} x (free, half constrained) x {n} streams")
        runtime_side.run_together(address, self.warm, [WARMUP_GEN] * n, params=self.half)
        for r in range(self.rounds):
            self.free.append(runtime_side.run_together(address, self.timed[2 * r], [self.gen_len] * n))
            before = runtime_side.status(address)
            self.mixed.append(runtime_side.run_together(address, self.timed[2 * r + 1], [self.gen_len] * n,
                                                        params=self.half))
            after = runtime_side.status(address)
            steps = after.mask_steps - before.mask_steps
            self.mask_ms.append(1e3 * (after.mask_s - before.mask_s) / steps if steps else float("nan"))
            f, m = summarize(self.free[-1])["total_tok_s"], summarize(self.mixed[-1])["total_tok_s"]
            self.bench.log(f"structured/runtime round {r + 1}: free {f:.1f} tok/s, half constrained {m:.1f} tok/s, "
                           f"masks {self.mask_ms[-1]:.3f} ms per step")

    def run_mlx(self, mlx: Any, rep: int) -> None:
        """Nothing: this workload compares the runtime with itself."""

    def outcome(self) -> Outcome:
        free = [summarize(t)["total_tok_s"] for t in self.free]
        mixed = [summarize(t)["total_tok_s"] for t in self.mixed]
        constrained_tokens = [sum(t.n_tokens for i, t in enumerate(ts) if i % 2 == 0) for ts in self.mixed]
        median = percentile([m / f for f, m in zip(free, mixed)], 50)  # of per-round ratios
        masks = self.mask_ms + [float("nan")] * (len(free) - len(self.mask_ms))
        rows = [[i + 1, self.streams, f, m, ratio(m, f), k] for i, (f, m, k) in enumerate(zip(free, mixed, masks))]
        rows.append(["median", self.streams, "", "", f"{median:.2f}", percentile(self.mask_ms, 50)])
        title = (f"structured output cost ({self.streams} streams, half with a JSON schema; prompt {self.prompt_len}, "
                 f"{self.gen_len} new tokens, greedy)")
        data = {"streams": self.streams, "free_tok_s": free, "half_constrained_tok_s": mixed, "ratio_median": median,
                "constrained_tokens": constrained_tokens, "schema": SCHEMA, "mask_ms_per_step": self.mask_ms}
        headers = ["round", "streams", "free tok/s", "half constrained tok/s", "ratio", "mask ms per step"]
        return Outcome(data, [table(title, headers, rows)])

