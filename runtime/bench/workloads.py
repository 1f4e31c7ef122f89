"""The single-stream and concurrency-sweep workloads: the runtime and mlx-lm on the same prompts.

Every workload warms both sides up first with prompts of the same shape but different
tokens (so the runtime's prefix cache cannot turn the timed run into cache hits).
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from runtime.bench import runtime_side
from runtime.bench.measure import StreamTiming, ratio, summarize
from runtime.bench.mlx_side import MlxLm
from runtime.bench.report import table

WARMUP_GEN = 8


@dataclass
class Bench:
    """What every workload needs: the model, prompt sampling, the services and the mlx-lm side."""

    model: Path
    vocab_size: int
    eos_ids: set[int]
    seed: int
    log: Callable[[str], None]
    mlx_prefill_batch: int = 8
    rng: random.Random = field(init=False)
    _mlx: MlxLm | None = field(default=None, init=False)

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)

    @property
    def mlx(self) -> MlxLm:
        """The mlx-lm side, loaded on first use."""
        if self._mlx is None:
            self.log("loading the model in-process for mlx-lm")
            self._mlx = MlxLm(self.model)
        return self._mlx

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


def _single_row(name: str, rt: dict, ml: dict, key: str) -> list:
    return [name, rt[key], ml[key], ratio(rt[key], ml[key])]


def single(bench: Bench, address: str, prompt_len: int, gen_len: int) -> Outcome:
    """One stream: runtime (streaming client) vs ``generate_step``; greedy tokens must agree."""
    warm = bench.prompt(prompt_len)
    bench.log(f"single: warm-up (prompt {prompt_len}, {WARMUP_GEN} tokens)")
    runtime_side.run_together(address, [warm], [min(gen_len, WARMUP_GEN)])
    bench.mlx.single(warm, min(gen_len, WARMUP_GEN))
    prompt = bench.prompt(prompt_len)
    bench.log(f"single: runtime, prompt {prompt_len}, {gen_len} new tokens")
    rt_t = runtime_side.run_together(address, [prompt], [gen_len])[0]
    bench.log("single: mlx-lm generate_step")
    ml_t = bench.mlx.single(prompt, gen_len)
    rt, ml = _single_view(rt_t), _single_view(ml_t)
    warnings = []
    match = rt_t.token_ids == ml_t.token_ids
    if not match:
        first = next((i for i, (a, b) in enumerate(zip(rt_t.token_ids, ml_t.token_ids)) if a != b), None)
        warnings.append(
            f"WARNING: single: runtime tokens differ from mlx-lm greedy tokens "
            f"(first difference at output position {first}; runtime {len(rt_t.token_ids)} tokens, "
            f"mlx-lm {len(ml_t.token_ids)})"
        )
    rows = [
        _single_row("decode tok/s", rt, ml, "decode_tok_s"),
        _single_row("end-to-end tok/s", rt, ml, "e2e_tok_s"),
        _single_row("TTFT ms", rt, ml, "ttft_ms"),
        _single_row("ITL p50 ms", rt, ml, "itl_p50_ms"),
        _single_row("ITL p95 ms", rt, ml, "itl_p95_ms"),
    ]
    title = f"single stream: prompt {prompt_len}, {gen_len} new tokens (tokens match mlx-lm: {'yes' if match else 'NO'})"
    tab = table(title, ["metric", "runtime", "mlx-lm", "runtime/mlx-lm"], rows)
    data = {"prompt_len": prompt_len, "gen_len": gen_len, "runtime": rt, "mlx_lm": ml, "tokens_match": match}
    return Outcome(data, [tab], warnings)


def _single_view(t: StreamTiming) -> dict[str, float]:
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


def sweep(bench: Bench, address: str, levels: list[int], prompt_len: int, gen_len: int) -> Outcome:
    """N concurrent streams per level: runtime client streams vs mlx-lm ``BatchGenerator``."""
    results = []
    for n in levels:
        warm = bench.prompts(n, prompt_len)
        bench.log(f"sweep c={n}: warm-up")
        runtime_side.run_together(address, warm, [min(gen_len, WARMUP_GEN)] * n)
        bench.mlx.batch(warm, [min(gen_len, WARMUP_GEN)] * n, prefill_batch=bench.mlx_prefill_batch)
        prompts = bench.prompts(n, prompt_len)
        bench.log(f"sweep c={n}: runtime ({n} x {prompt_len}+{gen_len})")
        rt_t = runtime_side.run_together(address, prompts, [gen_len] * n)
        bench.log(f"sweep c={n}: mlx-lm BatchGenerator")
        ml_t = bench.mlx.batch(prompts, [gen_len] * n, prefill_batch=bench.mlx_prefill_batch)
        rt, ml = summarize(rt_t), summarize(ml_t)
        results.append({"concurrency": n, "runtime": rt, "mlx_lm": ml, "token_agreement": _agreement(rt_t, ml_t)})
        bench.log(
            f"sweep c={n}: runtime {rt['total_tok_s']:.1f} tok/s, mlx-lm {ml['total_tok_s']:.1f} tok/s"
        )
    thr = [
        [
            r["concurrency"],
            r["runtime"]["total_tok_s"],
            r["mlx_lm"]["total_tok_s"],
            ratio(r["runtime"]["total_tok_s"], r["mlx_lm"]["total_tok_s"]),
            r["runtime"]["wall_s"],
            r["mlx_lm"]["wall_s"],
            f"{100 * r['token_agreement']:.0f}%",
        ]
        for r in results
    ]
    lat = [
        [
            r["concurrency"],
            r["runtime"]["ttft_p50_ms"],
            r["mlx_lm"]["ttft_p50_ms"],
            r["runtime"]["ttft_p95_ms"],
            r["mlx_lm"]["ttft_p95_ms"],
            r["runtime"]["itl_p50_ms"],
            r["mlx_lm"]["itl_p50_ms"],
            r["runtime"]["itl_p95_ms"],
            r["mlx_lm"]["itl_p95_ms"],
        ]
        for r in results
    ]
    shape = f"prompt {prompt_len}, {gen_len} new tokens per stream"
    tables = [
        table(
            f"sweep throughput ({shape})",
            ["streams", "runtime tok/s", "mlx-lm tok/s", "runtime/mlx-lm", "runtime wall s", "mlx-lm wall s",
             "same tokens"],
            thr,
        ),
        table(
            f"sweep latency, ms ({shape})",
            ["streams", "rt TTFT p50", "mlx TTFT p50", "rt TTFT p95", "mlx TTFT p95", "rt ITL p50", "mlx ITL p50",
             "rt ITL p95", "mlx ITL p95"],
            lat,
        ),
    ]
    data = {"prompt_len": prompt_len, "gen_len": gen_len, "levels": results}
    return Outcome(data, tables)
