"""The shared-prefix workload (prefix cache on vs off vs mlx-lm) and the worker-memory workload."""

from __future__ import annotations

from collections.abc import Callable

from runtime.bench import runtime_side
from runtime.bench.measure import StreamTiming, ratio, summarize
from runtime.bench.report import table
from runtime.bench.workloads import WARMUP_GEN, Bench, Outcome


def _prefix_prompts(bench: Bench, count: int, prefix_len: int, unique: tuple[int, int]) -> list[list[int]]:
    """``count`` prompts: one shared random prefix plus ``unique[0]..unique[1]`` random tokens each."""
    prefix = bench.prompt(prefix_len)
    return [prefix + bench.prompt(bench.rng.randint(*unique)) for _ in range(count)]


def prefix(
    bench: Bench,
    address_on: str,
    address_off: str,
    count: int,
    prefix_len: int,
    unique: tuple[int, int],
    gen_len: int,
) -> Outcome:
    """``count`` requests sharing a prefix, sent together: cache on, cache off, mlx-lm (no reuse).

    The timed prefix is new to the cache-on service ("cold": reuse only within the batch).
    A last cache-on run shares the same prefix with new suffixes ("prefix cached").
    """
    gens = [gen_len] * count
    # Warm-up: enough requests to fill one mlx-lm prefill batch and several runtime
    # prefill chunks of the timed shapes, without paying for the whole batch again.
    n_warm = min(count, max(8, bench.mlx_prefill_batch))
    warm = _prefix_prompts(bench, n_warm, prefix_len, unique)
    warm_gens = [min(gen_len, WARMUP_GEN)] * n_warm
    bench.log(f"prefix: warm-up ({n_warm} x {prefix_len}+{unique[0]}..{unique[1]})")
    runtime_side.run_together(address_on, warm, warm_gens)
    runtime_side.run_together(address_off, warm, warm_gens)
    bench.mlx.batch(warm, warm_gens, prefill_batch=bench.mlx_prefill_batch)

    prompts = _prefix_prompts(bench, count, prefix_len, unique)
    runs: dict[str, list[StreamTiming]] = {}
    bench.log("prefix: runtime, cache on (cold prefix)")
    runs["runtime, cache on"] = runtime_side.run_together(address_on, prompts, gens)
    bench.log("prefix: runtime, cache off")
    runs["runtime, cache off"] = runtime_side.run_together(address_off, prompts, gens)
    bench.log("prefix: mlx-lm BatchGenerator")
    runs["mlx-lm BatchGenerator"] = bench.mlx.batch(prompts, gens, prefill_batch=bench.mlx_prefill_batch)
    again = [prompts[0][:prefix_len] + bench.prompt(bench.rng.randint(*unique)) for _ in range(count)]
    bench.log("prefix: runtime, cache on, prefix already cached")
    runs["runtime, cache on, prefix already cached"] = runtime_side.run_together(address_on, again, gens)

    stats = {name: summarize(t) for name, t in runs.items()}
    on, off = stats["runtime, cache on"], stats["runtime, cache off"]
    ratios = {
        "ttft_p50_off_over_on": ratio(off["ttft_p50_ms"], on["ttft_p50_ms"]),
        "ttft_p95_off_over_on": ratio(off["ttft_p95_ms"], on["ttft_p95_ms"]),
        "ttft_p50_mlx_over_on": ratio(stats["mlx-lm BatchGenerator"]["ttft_p50_ms"], on["ttft_p50_ms"]),
        "throughput_on_over_mlx": ratio(on["total_tok_s"], stats["mlx-lm BatchGenerator"]["total_tok_s"]),
    }
    rows = [
        [name, s["ttft_p50_ms"], s["ttft_p95_ms"], s["total_tok_s"], s["wall_s"], s["cached_tokens"]]
        for name, s in stats.items()
    ]
    n_prompt = sum(len(p) for p in prompts)
    title = (
        f"shared prefix: {count} requests, prefix {prefix_len} + {unique[0]}-{unique[1]} unique tokens "
        f"({n_prompt} prompt tokens in all), {gen_len} new tokens each, sent together"
    )
    tab = table(title, ["run", "TTFT p50 ms", "TTFT p95 ms", "total tok/s", "wall s", "cached tokens"], rows)
    rtab = table(
        "shared prefix: ratios",
        ["ratio", "value"],
        [
            ["TTFT p50 cache off / cache on", ratios["ttft_p50_off_over_on"]],
            ["TTFT p95 cache off / cache on", ratios["ttft_p95_off_over_on"]],
            ["TTFT p50 mlx-lm / runtime cache on", ratios["ttft_p50_mlx_over_on"]],
            ["throughput runtime cache on / mlx-lm", ratios["throughput_on_over_mlx"]],
        ],
    )
    data = {
        "requests": count,
        "prefix_len": prefix_len,
        "unique": list(unique),
        "gen_len": gen_len,
        "prompt_tokens": n_prompt,
        "runs": stats,
        "ratios": ratios,
    }
    return Outcome(data, [tab, rtab])


def memory(
    bench: Bench,
    address: str,
    rss: Callable[[], dict[str, int | None]],
    requests: int,
    concurrency: int,
    prompt_range: tuple[int, int] = (8, 200),
    gen_range: tuple[int, int] = (1, 64),
    first: int = 100,
) -> Outcome:
    """RSS of the worker (and the scheduler) after the first ``first`` and after all ``requests``."""
    prompts = [bench.prompt(bench.rng.randint(*prompt_range)) for _ in range(requests)]
    gens = [bench.rng.randint(*gen_range) for _ in range(requests)]
    samples: list[dict] = [{"done": 0, **rss()}]
    every = max(requests // 20, 1)

    def on_done(done: int) -> None:
        if done == first or done % every == 0 or done == requests:
            samples.append({"done": done, **rss()})
            if done == first or done % (every * 4) == 0:
                w = samples[-1]["worker"]
                bench.log(f"memory: {done}/{requests} done, worker RSS {w / 2**20:.1f} MiB" if w else f"{done} done")

    bench.log(f"memory: {requests} mixed requests at concurrency {concurrency}")
    timings = runtime_side.run_pooled(address, prompts, gens, concurrency, on_done)
    samples.append({"done": requests, "after_idle": True, **rss()})
    at_first = next(s for s in samples if s["done"] == min(first, requests))
    at_end = next(s for s in samples if s["done"] == requests)

    def growth(key: str) -> float:
        a, b = at_first.get(key), at_end.get(key)
        return 100.0 * (b - a) / a if a and b else float("nan")

    stats = summarize(timings)
    mib = 2**20
    rows = []
    for key in ("worker", "scheduler"):
        rows.append(
            [
                key,
                (samples[0][key] or 0) / mib,
                (at_first[key] or 0) / mib,
                (at_end[key] or 0) / mib,
                f"{growth(key):+.1f}%",
            ]
        )
    title = (
        f"memory: RSS in MiB, {requests} mixed requests (prompt {prompt_range[0]}-{prompt_range[1]}, "
        f"{gen_range[0]}-{gen_range[1]} new tokens) at concurrency {concurrency}"
    )
    tab = table(title, ["process", "at start", f"after {first}", f"after {requests}", "growth"], rows)
    curve = table(
        "memory: worker RSS over the run, MiB",
        ["requests done", "worker RSS"],
        [[s["done"], (s["worker"] or 0) / mib] for s in samples if not s.get("after_idle")],
    )
    data = {
        "requests": requests,
        "concurrency": concurrency,
        "prompt_range": list(prompt_range),
        "gen_range": list(gen_range),
        "rss_samples": samples,
        "worker_growth_pct": growth("worker"),
        "scheduler_growth_pct": growth("scheduler"),
        "throughput": stats,
    }
    return Outcome(data, [tab, curve])
