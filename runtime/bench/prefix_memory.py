"""The shared-prefix workload (prefix cache on vs off vs mlx-lm) and the worker-memory workload."""

from __future__ import annotations

from collections.abc import Callable

from runtime.bench import runtime_side
from runtime.bench.measure import StreamTiming, median_summary, ratio, summarize
from runtime.bench.mlx_side import MlxLm
from runtime.bench.report import table
from runtime.bench.workloads import WARMUP_GEN, Bench, Outcome

ON, OFF, MLX, HOT = "runtime, cache on", "runtime, cache off", "mlx-lm BatchGenerator", "runtime, cache on, prefix already cached"


class Prefix:
    """``count`` requests sharing a prefix, sent together: cache on, cache off, mlx-lm (no reuse).

    The timed prefix is new to the cache-on service ("cold": any reuse happens within the
    batch). A last cache-on run sends the same prefix with new suffixes ("prefix already
    cached"). The warm-up uses another prefix and only enough requests to fill one mlx-lm
    prefill batch and several runtime prefill chunks of the timed shapes.
    """

    name = "prefix"

    def __init__(
        self, bench: Bench, count: int, prefix_len: int, unique: tuple[int, int], gen_len: int, repeats: int = 1
    ) -> None:
        self.bench, self.count, self.prefix_len, self.unique, self.gen_len = bench, count, prefix_len, unique, gen_len
        n_warm = min(count, max(8, bench.mlx_prefill_batch))
        self.warm = self._prompts(n_warm)
        self.warm_gens = [min(gen_len, WARMUP_GEN)] * n_warm
        self.prompts = [self._prompts(count) for _ in range(repeats)]  # a new (cold) prefix per repeat
        self.again = [[p[0][:prefix_len] + bench.prompt(bench.rng.randint(*unique)) for _ in range(count)]
                      for p in self.prompts]
        self.gens = [gen_len] * count
        self.runs: dict[str, list[list[StreamTiming]]] = {ON: [], OFF: [], MLX: [], HOT: []}

    def _prompts(self, count: int) -> list[list[int]]:
        prefix = self.bench.prompt(self.prefix_len)
        return [prefix + self.bench.prompt(self.bench.rng.randint(*self.unique)) for _ in range(count)]

    def run_runtime(self, addresses: dict[str, str], rep: int) -> None:
        log = self.bench.log
        log(f"prefix/runtime: warm-up ({len(self.warm)} x {self.prefix_len}+{self.unique[0]}..{self.unique[1]})")
        runtime_side.run_together(addresses["on"], self.warm, self.warm_gens)
        runtime_side.run_together(addresses["off"], self.warm, self.warm_gens)
        log(f"prefix/runtime: cache on, cold prefix ({self.count} requests)")
        self.runs[ON].append(runtime_side.run_together(addresses["on"], self.prompts[rep], self.gens))
        log("prefix/runtime: cache off")
        self.runs[OFF].append(runtime_side.run_together(addresses["off"], self.prompts[rep], self.gens))
        log("prefix/runtime: cache on, prefix already cached")
        self.runs[HOT].append(runtime_side.run_together(addresses["on"], self.again[rep], self.gens))

    def run_mlx(self, mlx: MlxLm, rep: int) -> None:
        self.bench.log("prefix/mlx-lm: warm-up, then BatchGenerator")
        mlx.batch(self.warm, self.warm_gens, prefill_batch=self.bench.mlx_prefill_batch)
        self.runs[MLX].append(mlx.batch(self.prompts[rep], self.gens, prefill_batch=self.bench.mlx_prefill_batch))

    def outcome(self) -> Outcome:
        per_run = {name: [summarize(t) for t in self.runs[name]] for name in (ON, OFF, MLX, HOT)}
        stats = {name: median_summary(runs) for name, runs in per_run.items()}
        on, off, ml = stats[ON], stats[OFF], stats[MLX]
        ratios = {
            "ttft_p50_off_over_on": ratio(off["ttft_p50_ms"], on["ttft_p50_ms"]),
            "ttft_p95_off_over_on": ratio(off["ttft_p95_ms"], on["ttft_p95_ms"]),
            "ttft_p50_off_over_cached": ratio(off["ttft_p50_ms"], stats[HOT]["ttft_p50_ms"]),
            "ttft_p50_mlx_over_on": ratio(ml["ttft_p50_ms"], on["ttft_p50_ms"]),
            "throughput_on_over_mlx": ratio(on["total_tok_s"], ml["total_tok_s"]),
        }
        rows = [[n, s["ttft_p50_ms"], s["ttft_p95_ms"], s["total_tok_s"], s["wall_s"], s["cached_tokens"]]
                for n, s in stats.items()]
        n_prompt = sum(len(p) for p in self.prompts[0])
        reps = len(per_run[ON])
        title = (
            f"shared prefix: {self.count} requests, prefix {self.prefix_len} + {self.unique[0]}-{self.unique[1]} "
            f"unique tokens (~{n_prompt} prompt tokens in all), {self.gen_len} new tokens each, sent together"
            + (f", median of {reps} runs" if reps > 1 else "")
        )
        tab = table(title, ["run", "TTFT p50 ms", "TTFT p95 ms", "total tok/s", "wall s", "cached tokens"], rows)
        rtab = table("shared prefix: ratios", ["ratio", "value"], [
            ["TTFT p50 cache off / cache on (cold prefix)", ratios["ttft_p50_off_over_on"]],
            ["TTFT p95 cache off / cache on (cold prefix)", ratios["ttft_p95_off_over_on"]],
            ["TTFT p50 cache off / cache on (prefix already cached)", ratios["ttft_p50_off_over_cached"]],
            ["TTFT p50 mlx-lm / runtime cache on", ratios["ttft_p50_mlx_over_on"]],
            ["throughput runtime cache on / mlx-lm", ratios["throughput_on_over_mlx"]],
        ])
        data = {"requests": self.count, "prefix_len": self.prefix_len, "unique": list(self.unique),
                "gen_len": self.gen_len, "prompt_tokens": n_prompt, "runs": stats, "ratios": ratios,
                "repeats": per_run}
        return Outcome(data, [tab, rtab])


def memory(
    bench: Bench,
    address: str,
    probe: Callable[[], dict[str, int | None]],
    requests: int,
    concurrency: int,
    prompt_range: tuple[int, int] = (8, 200),
    gen_range: tuple[int, int] = (1, 64),
    first: int = 100,
) -> Outcome:
    """RSS of the worker (and scheduler; GPU memory where nvidia-smi answers) after ``first`` and all requests."""
    prompts = [bench.prompt(bench.rng.randint(*prompt_range)) for _ in range(requests)]
    gens = [bench.rng.randint(*gen_range) for _ in range(requests)]
    samples: list[dict] = [{"done": 0, **probe()}]
    every = max(requests // 20, 1)

    def on_done(done: int) -> None:
        if done == first or done % every == 0 or done == requests:
            samples.append({"done": done, **probe()})
            if done == first or done % (every * 4) == 0:
                w = samples[-1]["worker"]
                bench.log(f"memory: {done}/{requests} done" + (f", worker RSS {w / 2**20:.1f} MiB" if w else ""))

    bench.log(f"memory: {requests} mixed requests at concurrency {concurrency}")
    timings = runtime_side.run_pooled(address, prompts, gens, concurrency, on_done)
    at_first = next(s for s in samples if s["done"] == min(first, requests))
    at_end = next(s for s in samples if s["done"] == requests)
    keys = [k for k in ("worker", "scheduler", "worker_gpu") if any(s.get(k) for s in samples)]

    def growth(key: str) -> float:
        a, b = at_first.get(key), at_end.get(key)
        return 100.0 * (b - a) / a if a and b else float("nan")

    mib = 2**20
    labels = {"worker": "worker RSS", "scheduler": "scheduler RSS", "worker_gpu": "worker GPU memory"}
    rows = [[labels[k], (samples[0].get(k) or 0) / mib, (at_first.get(k) or 0) / mib, (at_end.get(k) or 0) / mib,
             f"{growth(k):+.1f}%"] for k in keys]
    title = (
        f"memory: MiB, {requests} mixed requests (prompt {prompt_range[0]}-{prompt_range[1]}, "
        f"{gen_range[0]}-{gen_range[1]} new tokens) at concurrency {concurrency}"
    )
    tab = table(title, ["process", "at start", f"after {min(first, requests)}", f"after {requests}", "growth"], rows)
    curve = table("memory: over the run, MiB", ["requests done"] + [labels[k] for k in keys],
                  [[s["done"]] + [(s.get(k) or 0) / mib for k in keys] for s in samples])
    stats = summarize(timings)
    load = table(
        "memory: the mixed load itself",
        ["requests", "output tokens", "total tok/s", "TTFT p50 ms", "TTFT p95 ms", "ITL p50 ms", "ITL p95 ms", "wall s"],
        [[requests, stats["output_tokens"], stats["total_tok_s"], stats["ttft_p50_ms"], stats["ttft_p95_ms"],
          stats["itl_p50_ms"], stats["itl_p95_ms"], stats["wall_s"]]],
    )
    data = {"requests": requests, "concurrency": concurrency, "prompt_range": list(prompt_range),
            "gen_range": list(gen_range), "rss_samples": samples, "growth_pct": {k: growth(k) for k in keys},
            "throughput": stats}
    return Outcome(data, [tab, curve, load])
