"""Single stream in alternating pairs: the runtime and ``generate_step`` back to back, N times.

On shared or lent machines the host's speed moves by 20-50% within minutes (mlx-lm's own
single stream read 135-208 tok/s on one H200 host in ten minutes), so two medians taken
minutes apart (``single``, whose phases are separated by service restarts) can differ by more
than the effect being measured. Here the service stays up, mlx-lm is loaded in this process
at the same time, and each pair runs one request on each side on the same prompt, in
alternating order; the table gives each side's median and the median of the per-pair ratios,
with their range. The two sides still never compute at once: the idle service waits on its
sockets while mlx-lm runs, and the reverse.
"""

from __future__ import annotations

import math
import statistics
from typing import Any

from runtime.bench import runtime_side
from runtime.bench.long_prompt import first_difference
from runtime.bench.mlx_side import MlxLm
from runtime.bench.report import table
from runtime.bench.workloads import (
    NEAR_TIE_NATS,
    WARMUP_GEN,
    Bench,
    Outcome,
    single_view,
)


class PairedSingle:
    """``pairs`` alternating single-stream runs on each side (see the module docstring)."""

    name = "paired"

    def __init__(self, bench: Bench, prompt_len: int, gen_len: int, pairs: int) -> None:
        self.bench, self.prompt_len, self.gen_len = bench, prompt_len, gen_len
        self.warm = bench.prompt(prompt_len)
        self.prompts = [bench.prompt(prompt_len) for _ in range(pairs)]
        self.rt: list[dict[str, float]] = []
        self.ml: list[dict[str, float]] = []
        self.same: list[bool] = []
        self.divergences: list[dict[str, float] | None] = []

    def run(self, address: str, mlx: MlxLm) -> None:
        self.bench.log(f"paired: warm-up, then {len(self.prompts)} pairs of prompt {self.prompt_len}, "
                       f"{self.gen_len} new tokens")
        runtime_side.run_together(address, [self.warm], [min(self.gen_len, WARMUP_GEN)])
        mlx.single(self.warm, min(self.gen_len, WARMUP_GEN))
        for i, prompt in enumerate(self.prompts):
            sides = ("runtime", "mlx") if i % 2 == 0 else ("mlx", "runtime")
            timings = {}
            for side in sides:
                if side == "runtime":
                    timings[side] = runtime_side.run_together(address, [prompt], [self.gen_len])[0]
                else:
                    timings[side] = mlx.single(prompt, self.gen_len)
            self.rt.append(single_view(timings["runtime"]))
            self.ml.append(single_view(timings["mlx"]))
            self.same.append(timings["runtime"].token_ids == timings["mlx"].token_ids)
            self.divergences.append(divergence(prompt, timings["runtime"].token_ids, timings["mlx"].token_ids, mlx))

    def outcome(self) -> Outcome:
        data: dict[str, Any] = {"prompt_len": self.prompt_len, "gen_len": self.gen_len, "pairs": len(self.rt),
                                "runtime": self.rt, "mlx_lm": self.ml, "tokens_match": self.same,
                                "divergences": self.divergences}
        rows = pair_rows(self.rt, self.ml, (("decode tok/s", "decode_tok_s"), ("end-to-end tok/s", "e2e_tok_s"),
                                            ("TTFT ms", "ttft_ms"), ("ITL p50 ms", "itl_p50_ms")), data)
        return pair_outcome("paired", f"single stream in {len(self.rt)} alternating pairs: prompt {self.prompt_len}, "
                            f"{self.gen_len} new tokens", rows, data, self.same, self.divergences)


def divergence(prompt: list[int], ours: list[int], theirs: list[int], mlx: MlxLm) -> dict[str, float] | None:
    """Where the runtime's greedy tokens first leave mlx-lm's, and mlx-lm's own logprob gap
    between the two tokens there (a near-tie is rounding; a wide gap, a bug); None if they
    agree, or if one side merely stopped first."""
    first = first_difference(ours, theirs)
    if first is None or first >= min(len(ours), len(theirs)):
        return None
    return {"position": first, "logprob_gap": mlx.logprob_gap(prompt + theirs[:first], theirs[first], ours[first])}


def paired_ratios(runtime: list[float], mlx: list[float]) -> list[float]:
    """runtime / mlx-lm for each pair (pairs with a zero or missing mlx-lm value left out)."""
    return [round(r / m, 4) for r, m in zip(runtime, mlx) if m and not math.isnan(m) and not math.isnan(r)]


def pair_rows(rt: list[dict[str, float]], ml: list[dict[str, float]], metrics, data: dict[str, Any]) -> list[list]:
    """A table row per (name, key) of ``metrics``: each side's median, the median of the per-pair
    ratios and their range; the ratios go into ``data`` under ``{key}_pair_ratios``."""
    rows = []
    for name, key in metrics:
        ratios = paired_ratios([r[key] for r in rt], [m[key] for m in ml])
        spread = f"{min(ratios):.2f}-{max(ratios):.2f}" if ratios else "-"
        median_ratio = round(statistics.median(ratios), 2) if ratios else float("nan")
        rows.append([name, round(statistics.median(r[key] for r in rt), 2), round(statistics.median(m[key] for m in ml), 2),
                     median_ratio, spread])
        data[f"{key}_pair_ratios"] = ratios
    return rows


def pair_outcome(name: str, title: str, rows: list[list], data: dict[str, Any], same: list[bool],
                 divergences: list[dict[str, float] | None] = ()) -> Outcome:
    """A paired workload's table (``rows`` from ``pair_rows``) and a warning for any pair whose
    greedy tokens differ, with mlx-lm's logprob gap at each first difference ``divergences``
    knows; ``title`` gets the count of matching pairs."""
    matching = sum(same)
    tab = table(f"{title} (tokens match mlx-lm in {matching} of {len(same)} pairs)",
                ["metric", "runtime (median)", "mlx-lm (median)", "median of pair ratios", "pair ratios, range"], rows)
    warnings = []
    if matching < len(same):
        known = [d for d in divergences if d is not None]
        notes = "; ".join(f"from output position {d['position']}, mlx-lm's own logprob gap {d['logprob_gap']:.4g} "
                          f"nats" + (" (a near-tie)" if d["logprob_gap"] < NEAR_TIE_NATS else
                                     " (NOT a near-tie: look for a bug)") for d in known)
        warnings.append(f"WARNING: {name}: runtime tokens differ from mlx-lm greedy tokens in "
                        f"{len(same) - matching} of {len(same)} pairs" + (f": {notes}" if notes else ""))
    return Outcome(data, [tab], warnings)
