"""The ``mixed`` workload: an open-loop mix of prompt and reply lengths, then a shared-prefix wave.

Requests arrive as a Poisson process; prompt lengths are lognormal (clipped), reply lengths
uniform; after that part a wave of requests shares one long system prompt plus a short unique
suffix, arriving at the same rate. The runtime (through its HTTP gateway) and
``mlx_lm.server`` get the same texts on the same schedule, one after the other, never at
once. Prompts are random token ids decoded to text with the model's tokenizer, so both
servers tokenize the same text the same way; all replies are greedy (temperature 0). Both
sides are asked to do the same work: the model's EOS ids are banned (``logit_bias`` -100 on
each, which both servers apply), so every reply is ``max_tokens`` long. Greedy tokens part at
near-ties on a GPU, and after that the sides met EOS at different times: on an H100, mlx-lm's
side produced 10,908 tokens against the runtime's 72,844 for the same 364 requests (session 28),
and 2,779 against 13,839 in session 38. ``stop_at_eos`` lets replies stop at EOS, as a user's
would.
"""

from __future__ import annotations

import math
import random
import time
from dataclasses import dataclass
from typing import Callable

from runtime.bench.measure import ratio
from runtime.bench.open_loop import Request, RequestTiming, cache_split, per_request, run_schedule, summarize_open
from runtime.bench.process_cpu import CpuWindow, describe
from runtime.bench.report import table
from runtime.bench.service import ServiceError
from runtime.bench.workloads import WARMUP_GEN, Bench, Outcome

PROMPT_MIN = 16
PROMPT_SIGMA = 0.8  # of log(length): a median of 400 puts ~10% of prompts above 1100 tokens
SUFFIX = (16, 64)  # unique tokens after the shared prefix (``--mixed-prefix-suffix``'s default)
WARMUP_REQUESTS = 4
PROGRESS_EVERY = 50
SIDES = {"runtime": "runtime", "mlx_lm": "mlx-lm"}


@dataclass(frozen=True)
class MixedShape:
    """The workload's parameters (the ``--mixed-*`` and ``--goodput-*`` flags)."""

    requests: int = 300
    rate: float = 30.0  # requests per second
    prompt_median: int = 400
    prompt_max: int = 3000
    gen: tuple[int, int] = (32, 384)
    prefix_requests: int = 64
    prefix_len: int = 2000
    suffix: tuple[int, int] = SUFFIX  # each wave request's own tokens after the prefix (min, max)
    ttft_slo_ms: float = 1000.0
    tpot_slo_ms: float = 50.0
    stop_at_eos: bool = False  # else EOS is banned on both sides: replies of max_tokens, the same work


@dataclass(frozen=True)
class Draw:
    """One request before it has text: arrival, prompt length in drawn ids, reply budget."""

    at: float
    prompt_len: int
    max_tokens: int
    wave: str  # "main" or "prefix"


def arrivals(rng: random.Random, count: int, rate: float, start: float = 0.0) -> list[float]:
    """``count`` arrival times of a Poisson process of ``rate`` per second after ``start``."""
    out, t = [], start
    for _ in range(count):
        t += rng.expovariate(rate)
        out.append(t)
    return out


def prompt_lengths(rng: random.Random, count: int, median: int, lo: int, hi: int) -> list[int]:
    """Lognormal lengths of the given median, clipped to ``[lo, hi]``."""
    mu = math.log(max(median, 1))
    return [min(hi, max(lo, round(rng.lognormvariate(mu, PROMPT_SIGMA)))) for _ in range(count)]


def _hits(cache: dict) -> str:
    """``cache_split``'s counts, each with its TTFT p50 where it has requests ('-' if unknown)."""
    if not cache:
        return "-"
    return " / ".join(f"{cache[k]} ({cache[t]:.0f})" if cache[k] else "0"
                      for k, t in (("hits", "hit_ttft_p50_ms"), ("misses", "miss_ttft_p50_ms")))


def schedule(rng: random.Random, shape: MixedShape) -> list[Draw]:
    """The main part, then the shared-prefix wave continuing the same arrival process."""
    at = arrivals(rng, shape.requests, shape.rate)
    lens = prompt_lengths(rng, shape.requests, shape.prompt_median, PROMPT_MIN, shape.prompt_max)
    gens = [rng.randint(*shape.gen) for _ in range(shape.requests)]
    wave_at = arrivals(rng, shape.prefix_requests, shape.rate, start=at[-1] if at else 0.0)
    suffixes = [rng.randint(*shape.suffix) for _ in range(shape.prefix_requests)]
    wave_gens = [rng.randint(*shape.gen) for _ in range(shape.prefix_requests)]
    main = [Draw(a, n, g, "main") for a, n, g in zip(at, lens, gens)]
    return main + [Draw(a, shape.prefix_len + s, g, "prefix") for a, s, g in zip(wave_at, suffixes, wave_gens)]


class Mixed:
    """Draws the schedule and texts up front; ``run(side, url)`` per server, then ``outcome()``."""

    name = "mixed"

    def __init__(self, bench: Bench, shape: MixedShape) -> None:
        from transformers import AutoTokenizer

        if shape.requests + shape.prefix_requests < 1 or shape.rate <= 0:
            raise ValueError(f"mixed: needs at least one request and a positive rate, got {shape}")
        self.bench, self.shape = bench, shape
        self.shapes: dict[str, int] = {}
        self.cpu: dict[str, dict[str, float]] = {}  # per side: CPU cores busy by process over the schedule
        self.tokenizer = AutoTokenizer.from_pretrained(str(bench.model))
        self.draws = schedule(bench.rng, shape)
        prefix = bench.prompt(shape.prefix_len)

        def ids(d: Draw) -> list[int]:
            if d.wave != "prefix":
                return bench.prompt(d.prompt_len)
            # Prefix + suffix decoded as one id list: decoding the parts apart and joining the
            # texts could glue the last prefix word to the first suffix word.
            return prefix + bench.prompt(d.prompt_len - shape.prefix_len)

        bias = None if shape.stop_at_eos else {str(eos): -100.0 for eos in sorted(bench.eos_ids)} or None
        self.requests = [Request(d.at, self._text(ids(d)), d.max_tokens, d.wave, bias) for d in self.draws]
        warm_lens = prompt_lengths(bench.rng, WARMUP_REQUESTS, shape.prompt_median, PROMPT_MIN, shape.prompt_max)
        self.warm = [Request(0.0, self._text(bench.prompt(n)), WARMUP_GEN, logit_bias=bias) for n in warm_lens]
        # What the servers will see: a decoded text can re-encode to another length.
        self.prompt_tokens = [len(self.tokenizer.encode(r.prompt)) for r in self.requests + self.warm]
        self.runs: dict[str, tuple[float, list[RequestTiming]]] = {}

    def _text(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    @property
    def count(self) -> int:
        return len(self.requests)

    def max_context(self) -> int:
        """A service context that holds the longest prompt and the largest reply, with slack."""
        return max(self.prompt_tokens) + self.shape.gen[1] + 16

    def run(self, side: str, url: str, shapes: Callable[[], tuple[int, int]] | None = None,
            pid: int | None = None) -> None:
        """Warm ``url`` up with other texts, then send the whole schedule. ``shapes``: the
        service's (prefill shapes, decode traces) built so far, read after the warm-up and
        after the run (runtime side only). ``pid``: the server's process, whose CPU (by
        process role) and the bench client's own are reported over the schedule."""
        log = self.bench.log
        log(f"mixed/{SIDES[side]}: warm-up ({len(self.warm)} requests)")
        _, warm = run_schedule(url, self.warm)
        failed = [t.error for t in warm if t.error is not None]
        if failed:
            raise ServiceError(f"mixed/{SIDES[side]}: warm-up requests failed at {url}: {failed[0]}")
        log(f"mixed/{SIDES[side]}: {self.count} requests over ~{self.requests[-1].at:.1f} s")
        before = shapes() if shapes is not None else None

        def on_done(done: int) -> None:
            if done % PROGRESS_EVERY == 0 or done == self.count:
                log(f"mixed/{SIDES[side]}: {done}/{self.count} requests done")

        window = CpuWindow(pid, "scheduler" if side == "runtime" else "server").start() if pid else None
        client0 = time.process_time()
        self.runs[side] = run_schedule(url, self.requests, on_done)
        if window is not None:
            shares = window.stop().shares()
            if window.wall_s > 0:
                shares["bench client"] = (time.process_time() - client0) / window.wall_s
            self.cpu[side] = shares
            log(f"mixed/{SIDES[side]}: over the schedule, {describe(shares)}")
        if shapes is not None and before is not None:
            after = shapes()
            self.shapes = {"prefill_shapes_warm": before[0], "decode_traces_warm": before[1],
                           "prefill_shapes_new": after[0] - before[0], "decode_traces_new": after[1] - before[1]}

    def summary(self, side: str) -> dict:
        """Every number of one side: the whole run, and the shared-prefix wave on its own."""
        start, timings = self.runs[side]
        s = self.shape
        slo = (s.ttft_slo_ms / 1e3, s.tpot_slo_ms / 1e3)
        wave = [t for t, r in zip(timings, self.requests) if r.wave == "prefix"]
        out = summarize_open(timings, start, *slo)
        out["prefix_wave"] = summarize_open(wave, min((t.due for t in wave), default=start), *slo)
        out["prefix_wave"]["cache"] = cache_split(wave)
        out["per_request"] = per_request(timings, [r.wave for r in self.requests], start)
        return out

    def outcome(self) -> Outcome:
        s = self.shape
        stats = {side: self.summary(side) for side in SIDES if side in self.runs}
        rt, ml = stats.get("runtime", {}), stats.get("mlx_lm", {})
        keys = ("throughput_tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "goodput")
        ratios = {f"{k}_runtime_over_mlx": ratio(rt.get(k), ml.get(k)) for k in keys}
        warnings = [
            f"WARNING: mixed: {SIDES[side]}: {st['failed']} of {st['requests']} requests failed: "
            + "; ".join(st["errors"])
            for side, st in stats.items() if st["failed"]
        ]
        if rt and ml and abs(rt["output_tokens"] - ml["output_tokens"]) > 0.01 * max(rt["output_tokens"], 1):
            short = "; ".join(
                f"{SIDES[side]}: {st['short_replies']['count']} replies short of max_tokens by "
                f"{st['short_replies']['tokens_short']} tokens (finish reasons {st['short_replies']['finish_reasons']}), "
                f"{st['short_replies']['without_usage']} streams without usage"
                for side, st in stats.items())
            warnings.append(f"WARNING: mixed: the sides generated {rt['output_tokens']} and {ml['output_tokens']} "
                            f"tokens: their throughputs are not for the same work ({short})")

        def row(name: str, get, with_ratio: bool = True) -> list:
            a, b = (get(st) if st else None for st in (rt, ml))
            return [name, a, b, ratio(a, b) if with_ratio and isinstance(a, (int, float)) else "-"]

        rows = [
            row("requests completed / failed", lambda st: f"{st['completed']} / {st['failed']}", False),
            row("output tokens", lambda st: st["output_tokens"], False),
            row("throughput, output tok/s", lambda st: st["throughput_tok_s"]),
            row("TTFT p50 ms", lambda st: st["ttft_p50_ms"]),
            row("TTFT p99 ms", lambda st: st["ttft_p99_ms"]),
            row("TPOT p50 ms", lambda st: st["tpot_p50_ms"]),
            row("TPOT p99 ms", lambda st: st["tpot_p99_ms"]),
            row(f"goodput % (TTFT <= {s.ttft_slo_ms:g} ms, TPOT <= {s.tpot_slo_ms:g} ms)",
                lambda st: 100 * st["goodput"]),
            row("prefix wave: cached prompt tokens", lambda st: st["prefix_wave"]["cached_tokens"], False),
            row("prefix wave: TTFT p50 ms", lambda st: st["prefix_wave"]["ttft_p50_ms"]),
            row("prefix wave: requests with / without a cache hit (TTFT p50 ms)",
                lambda st: _hits(st["prefix_wave"]["cache"]), False),
            row("latest send after its arrival time, ms", lambda st: st["send_lag_max_ms"], False),
        ]
        if self.shapes:
            per_k = 1000 / max(self.count, 1)
            rows.append([f"new prefill shapes / decode traces per 1,000 requests (after warm-up: "
                         f"{self.shapes['prefill_shapes_warm']} / {self.shapes['decode_traces_warm']})",
                         f"{self.shapes['prefill_shapes_new'] * per_k:.0f} / {self.shapes['decode_traces_new'] * per_k:.0f}",
                         "-", "-"])
        title = (
            f"mixed load over HTTP: {s.requests} requests at {s.rate:g}/s (Poisson; prompt lognormal, median "
            f"{s.prompt_median}, {PROMPT_MIN}-{s.prompt_max} tokens; {s.gen[0]}-{s.gen[1]} new tokens), then "
            f"{s.prefix_requests} sharing a {s.prefix_len}-token prefix (+{s.suffix[0]}-{s.suffix[1]} unique); greedy, "
            + ("streamed, stop at EOS" if s.stop_at_eos else "streamed, EOS banned (every reply max_tokens long)")
        )
        tab = table(title, ["metric", "runtime", "mlx-lm server", "runtime/mlx-lm"], rows)
        data = {
            "shape": vars(s) | {"gen": list(s.gen), "prompt_min": PROMPT_MIN, "prompt_sigma": PROMPT_SIGMA,
                                "suffix": list(s.suffix)},
            "requests": self.count,
            "waves": {"main": s.requests, "prefix": s.prefix_requests},
            "prompt_tokens": sum(self.prompt_tokens[: self.count]),
            "max_prompt_tokens": max(self.prompt_tokens[: self.count]),
            "runtime": rt,
            "mlx_lm": ml,
            "ratios": ratios,
            "runtime_shapes": self.shapes,
            "cpu_cores": self.cpu,
        }
        return Outcome(data, [tab], warnings)

