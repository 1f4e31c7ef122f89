"""The ``sampling`` workload: N streams with the full sampling set against greedy, in the same service run.

Runtime only: it measures what per-row sampling (filters, penalties, seeded draws, logprobs)
costs inside the batched decode step, against plain greedy on the same prompts' shape.
Greedy and sampled runs alternate, so a drifting machine affects both alike.
"""

from __future__ import annotations

from typing import Any

from runtime.bench import runtime_side
from runtime.bench.measure import StreamTiming, percentile, ratio, summarize
from runtime.bench.report import table
from runtime.bench.workloads import WARMUP_GEN, Bench, Outcome

SAMPLED = dict(temperature=0.8, top_p=0.95, top_k=50, frequency_penalty=0.5, logprobs=True, top_logprobs=5)


class Sampling:
    """``streams`` concurrent requests, greedy and then with ``SAMPLED``, ``rounds`` times."""

    name = "sampling"

    def __init__(self, bench: Bench, streams: int, prompt_len: int, gen_len: int, rounds: int = 3) -> None:
        self.bench, self.streams, self.prompt_len, self.gen_len = bench, streams, prompt_len, gen_len
        self.rounds = rounds
        self.warm = bench.prompts(streams, prompt_len)
        self.timed = [bench.prompts(streams, prompt_len) for _ in range(2 * rounds)]
        self.greedy: list[list[StreamTiming]] = []
        self.sampled: list[list[StreamTiming]] = []

    def run_runtime(self, addresses: dict[str, str], rep: int) -> None:
        n, address = self.streams, addresses["on"]
        self.bench.log(f"sampling/runtime: warm-up, then {self.rounds} x (greedy, sampled) x {n} streams")
        runtime_side.run_together(address, self.warm, [WARMUP_GEN] * n)
        runtime_side.run_together(address, self.warm, [WARMUP_GEN] * n, params=SAMPLED)
        for r in range(self.rounds):
            self.greedy.append(runtime_side.run_together(address, self.timed[2 * r], [self.gen_len] * n))
            self.sampled.append(runtime_side.run_together(address, self.timed[2 * r + 1], [self.gen_len] * n,
                                                          params=SAMPLED))
            g, s = summarize(self.greedy[-1])["total_tok_s"], summarize(self.sampled[-1])["total_tok_s"]
            self.bench.log(f"sampling/runtime round {r + 1}: greedy {g:.1f} tok/s, sampled {s:.1f} tok/s")

    def run_mlx(self, mlx: Any, rep: int) -> None:
        """Nothing: this workload compares the runtime with itself."""

    def outcome(self) -> Outcome:
        """Per round: greedy and sampled tok/s and their ratio; the median of the per-round ratios."""
        greedy = [summarize(t)["total_tok_s"] for t in self.greedy]
        sampled = [summarize(t)["total_tok_s"] for t in self.sampled]
        median = percentile([s / g for g, s in zip(greedy, sampled)], 50)  # of per-round ratios
        params = ", ".join(f"{k}={v}" for k, v in SAMPLED.items())
        rows = [[i + 1, self.streams, g, s, ratio(s, g)] for i, (g, s) in enumerate(zip(greedy, sampled))]
        rows.append(["median", self.streams, "", "", f"{median:.2f}"])
        title = f"sampling cost ({self.streams} streams, prompt {self.prompt_len}, {self.gen_len} new tokens; {params})"
        data = {"streams": self.streams, "greedy_tok_s": greedy, "sampled_tok_s": sampled, "ratio_median": median,
                "params": SAMPLED}
        headers = ["round", "streams", "greedy tok/s", "sampled tok/s", "sampled/greedy"]
        return Outcome(data, [table(title, headers, rows)])
