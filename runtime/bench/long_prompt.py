"""The ``long`` workload: one long prompt at a time, runtime (ZMQ client) vs mlx-lm's ``generate_step``.

Per prompt length: the time to the first token (prefill of the whole prompt) and the
single-stream decode rate after it, at that context, plus whether the greedy tokens agree.
Each side is warmed up with a short prompt first, so neither pays its one-time start-up costs
inside the timed prefill. With ``warm_lengths`` (``--long-warm``) each side also runs one prompt
of every length first (other tokens, so no prefix-cache hit): the timed prefill then excludes
the first-use builds a new shape costs on a GPU (cuDNN attention graphs, kernels), which
otherwise both sides pay inside it.
"""

from __future__ import annotations

from runtime.bench import runtime_side
from runtime.bench.measure import StreamTiming, median_summary, ratio
from runtime.bench.mlx_side import MlxLm
from runtime.bench.report import table
from runtime.bench.workloads import (
    NEAR_TIE_NATS,
    WARMUP_GEN,
    Bench,
    Outcome,
    single_view,
)

WARM_LEN = 64


def first_difference(a: list[int], b: list[int]) -> int | None:
    """The first output position where two token lists differ (a length difference counts); None if equal."""
    if a == b:
        return None
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


class LongPrompt:
    """A plan like ``Single``: ``run_runtime`` while the service is up, ``run_mlx`` in-process, ``outcome``."""

    name = "long"

    def __init__(self, bench: Bench, lens: list[int], gen_len: int, repeats: int = 1,
                 warm_lengths: bool = False) -> None:
        self.bench, self.lens, self.gen_len = bench, list(lens), gen_len
        self.warm = bench.prompt(WARM_LEN)
        self.warm_long = [bench.prompt(n) for n in self.lens] if warm_lengths else []
        self.prompts = {n: [bench.prompt(n) for _ in range(repeats)] for n in self.lens}
        self.rt: dict[int, list[StreamTiming]] = {n: [] for n in self.lens}
        self.ml: dict[int, list[StreamTiming]] = {n: [] for n in self.lens}
        self.gaps: dict[int, float] = {}  # mlx-lm's own logprob gap at the first difference, per length

    def run_runtime(self, addresses: dict[str, str], rep: int) -> None:
        log = self.bench.log
        log(f"long/runtime: warm-up ({WARM_LEN} tokens), then prompts of {', '.join(map(str, self.lens))}")
        runtime_side.run_together(addresses["on"], [self.warm], [WARMUP_GEN])
        for prompt in self.warm_long:
            log(f"long/runtime: warm-up prompt of {len(prompt)} tokens")
            runtime_side.run_together(addresses["on"], [prompt], [WARMUP_GEN])
        for n in self.lens:
            timing = runtime_side.run_together(addresses["on"], [self.prompts[n][rep]], [self.gen_len])[0]
            self.rt[n].append(timing)
            log(f"long/runtime: prompt {n}: TTFT {1e3 * timing.ttft:.0f} ms")

    def run_mlx(self, mlx: MlxLm, rep: int) -> None:
        log = self.bench.log
        log(f"long/mlx-lm: warm-up ({WARM_LEN} tokens), then generate_step")
        mlx.single(self.warm, WARMUP_GEN)
        for prompt in self.warm_long:
            log(f"long/mlx-lm: warm-up prompt of {len(prompt)} tokens")
            mlx.single(prompt, WARMUP_GEN)
        for n in self.lens:
            timing = mlx.single(self.prompts[n][rep], self.gen_len)
            self.ml[n].append(timing)
            log(f"long/mlx-lm: prompt {n}: TTFT {1e3 * timing.ttft:.0f} ms")
            ours = self.rt[n][rep].token_ids if rep < len(self.rt[n]) else []
            first = first_difference(ours, timing.token_ids)
            if first is not None and n not in self.gaps and first < min(len(ours), len(timing.token_ids)):
                # How close mlx-lm itself found the two tokens: a near-tie is rounding, a wide gap a bug.
                ml_ids = timing.token_ids
                self.gaps[n] = mlx.logprob_gap(self.prompts[n][rep] + ml_ids[:first], ml_ids[first], ours[first])

    def outcome(self) -> Outcome:
        results, rows, warnings = [], [], []
        for n in self.lens:
            rt = median_summary([single_view(t) for t in self.rt[n]])
            ml = median_summary([single_view(t) for t in self.ml[n]])
            diffs = [first_difference(a.token_ids, b.token_ids) for a, b in zip(self.rt[n], self.ml[n])]
            first = next((d for d in diffs if d is not None), None)
            ratios = {"ttft_runtime_over_mlx": ratio(rt["ttft_ms"], ml["ttft_ms"]),
                      "decode_runtime_over_mlx": ratio(rt["decode_tok_s"], ml["decode_tok_s"])}
            results.append({"prompt_len": n, "runtime": rt, "mlx_lm": ml, "ratios": ratios,
                            "tokens_match": first is None, "first_difference": first,
                            "first_difference_logprob_gap": self.gaps.get(n),
                            "repeats": {"runtime": [single_view(t) for t in self.rt[n]],
                                        "mlx_lm": [single_view(t) for t in self.ml[n]]}})
            rows.append([n, rt["ttft_ms"], ml["ttft_ms"], ratios["ttft_runtime_over_mlx"], rt["decode_tok_s"],
                         ml["decode_tok_s"], ratios["decode_runtime_over_mlx"],
                         "yes" if first is None else f"NO, from token {first}" + _gap_note(self.gaps.get(n))])
            if first is not None:
                gap = self.gaps.get(n)
                warnings.append(
                    f"WARNING: long: prompt {n}: runtime greedy tokens differ from mlx-lm's in "
                    f"{sum(d is not None for d in diffs)} of {len(diffs)} runs, first at output position {first}"
                    + (f"; mlx-lm's own logprob gap between the two tokens there is {gap:.4g} nats"
                       + (" (a near-tie)" if gap < NEAR_TIE_NATS else " (NOT a near-tie: look for a bug)")
                       if gap is not None else "")
                )
        reps = len(self.rt[self.lens[0]]) if self.lens else 0
        title = (f"long prompts, one at a time: {self.gen_len} new tokens each, greedy"
                 + (f", median of {reps} runs" if reps > 1 else "")
                 + (", after a warm-up prompt of every length" if self.warm_long else ""))
        tab = table(title, ["prompt tokens", "rt TTFT ms", "mlx TTFT ms", "TTFT rt/mlx", "rt decode tok/s",
                            "mlx decode tok/s", "decode rt/mlx", "same tokens"], rows)
        return Outcome({"gen_len": self.gen_len, "lens": self.lens, "warm_lengths": bool(self.warm_long),
                        "results": results}, [tab], warnings)


def _gap_note(gap: float | None) -> str:
    return "" if gap is None else f" ({gap:.3g} nats)"
