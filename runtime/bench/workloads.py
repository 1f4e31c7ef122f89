"""The single-stream and concurrency-sweep workloads: the runtime and mlx-lm on the same prompts.

A workload draws its prompts up front, then runs its runtime side (``run_runtime``, while
the services are up) and its mlx-lm side (``run_mlx``, in-process, after the services are
gone, so the two never share the device), then ``outcome()`` compares them. Each side is
warmed up first with prompts of the same shape but other tokens, so the runtime's prefix
cache cannot turn a timed run into cache hits.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from runtime.bench import runtime_side
from runtime.bench.measure import StreamTiming, median_summary, ratio, summarize
from runtime.bench.mlx_side import MlxLm
from runtime.bench.report import table

WARMUP_GEN = 8
NEAR_TIE_NATS = 0.1  # a first difference this close in mlx-lm's own logprobs is a rounding-level tie


@dataclass
class Bench:
    """What every workload needs: the model, prompt sampling and progress logging."""

    model: Path
    vocab_size: int
    eos_ids: set[int]
    seed: int
    log: Callable[[str], None]
    mlx_prefill_batch: int = 8
    rng: random.Random = field(init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    def prompt(self, n: int) -> list[int]:
        """``n`` random token ids, never an EOS id."""
        out = []
        while len(out) < n:
            t = self.rng.randrange(self.vocab_size)
            if t not in self.eos_ids:
                out.append(t)
        return out

    def prompts(self, count: int, n: int) -> list[list[int]]:
        return [self.prompt(n) for _ in range(count)]


@dataclass
class Outcome:
    """A workload's numbers (for JSON), its tables and any warnings."""

    data: dict[str, Any]
    tables: list[str]
    warnings: list[str] = field(default_factory=list)


class Single:
    """One stream: runtime (streaming client) vs ``generate_step``; greedy tokens must agree."""

    name = "single"

    def __init__(self, bench: Bench, prompt_len: int, gen_len: int, repeats: int = 1) -> None:
        self.bench, self.prompt_len, self.gen_len = bench, prompt_len, gen_len
        self.warm = bench.prompt(prompt_len)
        self.prompts = [bench.prompt(prompt_len) for _ in range(repeats)]
        self.rt: list[StreamTiming] = []
        self.ml: list[StreamTiming] = []
        self.tie_gap: float | None = None

    def run_runtime(self, addresses: dict[str, str], rep: int) -> None:
        self.bench.log(f"single/runtime: warm-up, then prompt {self.prompt_len}, {self.gen_len} new tokens")
        runtime_side.run_together(addresses["on"], [self.warm], [min(self.gen_len, WARMUP_GEN)])
        self.rt.append(runtime_side.run_together(addresses["on"], [self.prompts[rep]], [self.gen_len])[0])

    def run_mlx(self, mlx: MlxLm, rep: int) -> None:
        self.bench.log("single/mlx-lm: warm-up, then generate_step")
        mlx.single(self.warm, min(self.gen_len, WARMUP_GEN))
        self.ml.append(mlx.single(self.prompts[rep], self.gen_len))
        first = self._first_difference(rep)
        if first is not None and self.tie_gap is None and first < len(self.rt[rep].token_ids):
            ml_ids = self.ml[rep].token_ids
            self.tie_gap = mlx.logprob_gap(self.prompts[rep] + ml_ids[:first], ml_ids[first],
                                           self.rt[rep].token_ids[first])

    def _first_difference(self, rep: int) -> int | None:
        a, b = self.rt[rep].token_ids, self.ml[rep].token_ids
        if a == b:
            return None
        return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))

    def outcome(self) -> Outcome:
        rt = median_summary([single_view(t) for t in self.rt])
        ml = median_summary([single_view(t) for t in self.ml])
        firsts = [self._first_difference(i) for i in range(len(self.rt))]
        first = next((f for f in firsts if f is not None), None)
        warnings = []
        if first is not None:
            gap = self.tie_gap
            kind = (
                f"mlx-lm's own logprob gap between the two tokens there is {gap:.4f} nats"
                + (" (a near-tie: rounding in a different kernel order can flip it)" if gap < NEAR_TIE_NATS else
                   " (NOT a near-tie: look for a real bug)")
                if gap is not None else "no logprob gap computed"
            )
            warnings.append(
                f"WARNING: single: runtime tokens differ from mlx-lm greedy tokens in "
                f"{sum(f is not None for f in firsts)} of {len(firsts)} runs, first at output position {first}; {kind}"
            )
        rows = [
            [name, rt[key], ml[key], ratio(rt[key], ml[key])]
            for name, key in (
                ("decode tok/s", "decode_tok_s"),
                ("end-to-end tok/s", "e2e_tok_s"),
                ("TTFT ms", "ttft_ms"),
                ("ITL p50 ms", "itl_p50_ms"),
                ("ITL p95 ms", "itl_p95_ms"),
            )
        ]
        idle = [t.worker_idle_share for t in self.rt if t.worker_idle_share is not None]
        if idle:
            rows.append(["worker idle share %", round(100 * sorted(idle)[len(idle) // 2], 1), "-", "-"])
        same = "yes" if first is None else f"NO, first difference at token {first}"
        title = (f"single stream: prompt {self.prompt_len}, {self.gen_len} new tokens{_of(len(self.rt))} "
                 f"(tokens match mlx-lm: {same})")
        tab = table(title, ["metric", "runtime", "mlx-lm", "runtime/mlx-lm"], rows)
        data = {
            "prompt_len": self.prompt_len,
            "gen_len": self.gen_len,
            "runtime": rt,
            "mlx_lm": ml,
            "repeats": {"runtime": [single_view(t) for t in self.rt], "mlx_lm": [single_view(t) for t in self.ml]},
            "tokens_match": first is None,
            "first_difference": first,
            "first_difference_logprob_gap": self.tie_gap,
        }
        return Outcome(data, [tab], warnings)


def _of(repeats: int) -> str:
    return f", median of {repeats} runs" if repeats > 1 else ""


def single_view(t: StreamTiming) -> dict[str, float]:
    s = summarize([t])
    e2e = t.n_tokens / (t.end - t.start) if t.end > t.start else float("nan")
    return {
        "output_tokens": t.n_tokens,
        "decode_tok_s": s["decode_tok_s"],
        "e2e_tok_s": e2e,
        "ttft_ms": s["ttft_p50_ms"],
        "itl_p50_ms": s["itl_p50_ms"],
        "itl_p95_ms": s["itl_p95_ms"],
        "wall_s": s["wall_s"],
    }


def _agreement(a: list[StreamTiming], b: list[StreamTiming]) -> float:
    """Fraction of streams whose greedy tokens are identical on both sides."""
    same = sum(1 for x, y in zip(a, b) if x.token_ids == y.token_ids)
    return same / len(a) if a else float("nan")


class Sweep:
    """N concurrent streams per level: runtime client streams vs mlx-lm ``BatchGenerator``."""

    name = "sweep"

    def __init__(self, bench: Bench, levels: list[int], prompt_len: int, gen_len: int, repeats: int = 1) -> None:
        self.bench, self.levels, self.prompt_len, self.gen_len = bench, levels, prompt_len, gen_len
        self.warm = {n: bench.prompts(n, prompt_len) for n in levels}
        self.timed = {n: [bench.prompts(n, prompt_len) for _ in range(repeats)] for n in levels}
        self.rt: dict[int, list[list[StreamTiming]]] = {n: [] for n in levels}
        self.ml: dict[int, list[list[StreamTiming]]] = {n: [] for n in levels}

    def run_runtime(self, addresses: dict[str, str], rep: int) -> None:
        for n in self.levels:
            self.bench.log(f"sweep/runtime c={n}: warm-up, then {n} x {self.prompt_len}+{self.gen_len}")
            runtime_side.run_together(addresses["on"], self.warm[n], [min(self.gen_len, WARMUP_GEN)] * n)
            self.rt[n].append(runtime_side.run_together(addresses["on"], self.timed[n][rep], [self.gen_len] * n))
            self.bench.log(f"sweep/runtime c={n}: {summarize(self.rt[n][-1])['total_tok_s']:.1f} tok/s")

    def run_mlx(self, mlx: MlxLm, rep: int) -> None:
        for n in self.levels:
            self.bench.log(f"sweep/mlx-lm c={n}: warm-up, then BatchGenerator")
            mlx.batch(self.warm[n], [min(self.gen_len, WARMUP_GEN)] * n, prefill_batch=self.bench.mlx_prefill_batch)
            self.ml[n].append(mlx.batch(self.timed[n][rep], [self.gen_len] * n,
                                        prefill_batch=self.bench.mlx_prefill_batch))
            self.bench.log(f"sweep/mlx-lm c={n}: {summarize(self.ml[n][-1])['total_tok_s']:.1f} tok/s")

    def outcome(self) -> Outcome:
        results = []
        for n in self.levels:
            rt_runs = [summarize(t) for t in self.rt[n]]
            ml_runs = [summarize(t) for t in self.ml[n]]
            agree = [_agreement(a, b) for a, b in zip(self.rt[n], self.ml[n])]
            idle = sorted(t[0].worker_idle_share for t in self.rt[n] if t and t[0].worker_idle_share is not None)
            results.append({
                "concurrency": n, "runtime": median_summary(rt_runs), "mlx_lm": median_summary(ml_runs),
                "token_agreement": min(agree), "repeats": {"runtime": rt_runs, "mlx_lm": ml_runs},
                "worker_idle_share": idle[len(idle) // 2] if idle else None,
            })
        thr = [
            [r["concurrency"], r["runtime"]["total_tok_s"], r["mlx_lm"]["total_tok_s"],
             ratio(r["runtime"]["total_tok_s"], r["mlx_lm"]["total_tok_s"]), r["runtime"]["wall_s"],
             r["mlx_lm"]["wall_s"], f"{100 * r['token_agreement']:.0f}%",
             "-" if r["worker_idle_share"] is None else f"{100 * r['worker_idle_share']:.1f}%"]
            for r in results
        ]
        lat = [
            [r["concurrency"]] + [r[side][key] for key in ("ttft_p50_ms", "ttft_p95_ms", "itl_p50_ms", "itl_p95_ms")
                                  for side in ("runtime", "mlx_lm")]
            for r in results
        ]
        reps = len(self.rt[self.levels[0]])
        shape = f"prompt {self.prompt_len}, {self.gen_len} new tokens per stream{_of(reps)}"
        tables = [
            table(f"sweep throughput ({shape})",
                  ["streams", "runtime tok/s", "mlx-lm tok/s", "runtime/mlx-lm", "runtime wall s", "mlx-lm wall s",
                   "same tokens", "worker idle"], thr),
            table(f"sweep latency, ms ({shape})",
                  ["streams", "rt TTFT p50", "mlx TTFT p50", "rt TTFT p95", "mlx TTFT p95", "rt ITL p50",
                   "mlx ITL p50", "rt ITL p95", "mlx ITL p95"], lat),
        ]
        return Outcome({"prompt_len": self.prompt_len, "gen_len": self.gen_len, "levels": results}, tables)
