"""A fresh service's first request against a fresh mlx-lm's first ``generate_step``, in pairs.

A service that is fast only once warm makes its first users wait: whatever its warm-up did
not compile (decode traces, kernels) the first request pays. Each pair starts a new service
(``runtime up``, as a user would) and sends it one single-stream request with no warm-up,
then loads the model afresh in this process and runs ``generate_step`` once, the two sides in
alternating order; the table gives each side's median and the median of the per-pair ratios,
with their range. Start-up itself (the time to the "serving" line) is reported beside them.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

from runtime.bench import runtime_side
from runtime.bench.mlx_side import MlxLm
from runtime.bench.paired import divergence, pair_outcome, pair_rows
from runtime.bench.workloads import Bench, Outcome, single_view


class FirstRequest:
    """``pairs`` pairs of (fresh service, first request) and (fresh mlx-lm, first stream)."""

    name = "first"

    def __init__(self, bench: Bench, prompt_len: int, gen_len: int, pairs: int) -> None:
        self.bench, self.prompt_len, self.gen_len = bench, prompt_len, gen_len
        self.prompts = [bench.prompt(prompt_len) for _ in range(pairs)]
        self.rt: list[dict[str, float]] = []
        self.ml: list[dict[str, float]] = []
        self.startup_s: list[float] = []
        self.same: list[bool] = []
        self.divergences: list[dict[str, float] | None] = []  # where known: the runtime side ran first

    def run(self, service: Callable[[], AbstractContextManager[Any]], load_mlx: Callable[[], MlxLm]) -> None:
        """``service()``: a context manager that starts a new service and yields it (``.address``)."""
        for i, prompt in enumerate(self.prompts):
            timings = {}
            gap = None
            for side in (("runtime", "mlx") if i % 2 == 0 else ("mlx", "runtime")):
                if side == "runtime":
                    started = time.perf_counter()
                    with service() as svc:
                        self.startup_s.append(time.perf_counter() - started)
                        self.bench.log(svc.banner)  # its limits and pool: what the start-up prepared for
                        timings[side] = runtime_side.run_together(svc.address, [prompt], [self.gen_len])[0]
                else:
                    mlx = load_mlx()
                    try:
                        timings[side] = mlx.single(prompt, self.gen_len)
                        if "runtime" in timings:  # mlx-lm still loaded: how close were the two tokens?
                            gap = divergence(prompt, timings["runtime"].token_ids, timings[side].token_ids, mlx)
                    finally:
                        mlx.release()
            self.rt.append(single_view(timings["runtime"]))
            self.ml.append(single_view(timings["mlx"]))
            self.same.append(timings["runtime"].token_ids == timings["mlx"].token_ids)
            self.divergences.append(gap)
            self.bench.log(f"first/pair {i + 1}: runtime {self.rt[-1]['decode_tok_s']:.1f} tok/s, "
                           f"mlx-lm {self.ml[-1]['decode_tok_s']:.1f} tok/s")

    def outcome(self) -> Outcome:
        data: dict[str, Any] = {"prompt_len": self.prompt_len, "gen_len": self.gen_len, "pairs": len(self.rt),
                                "runtime": self.rt, "mlx_lm": self.ml, "startup_s": self.startup_s,
                                "tokens_match": self.same, "divergences": self.divergences}
        rows = pair_rows(self.rt, self.ml, (("decode tok/s", "decode_tok_s"), ("TTFT ms", "ttft_ms"),
                                            ("ITL p50 ms", "itl_p50_ms")), data)
        rows.append(["service start-up s (to its serving line)", round(statistics.median(self.startup_s), 1), "-",
                     "-", f"{min(self.startup_s):.1f}-{max(self.startup_s):.1f}"])
        return pair_outcome("first", f"first request of a fresh service, {len(self.rt)} alternating pairs: prompt "
                            f"{self.prompt_len}, {self.gen_len} new tokens", rows, data, self.same,
                            self.divergences)
