"""The ``http`` workload: the same requests through the HTTP gateway and through the ZMQ client.

One service with ``[http]``; runtime only (it compares the gateway with the client it wraps).
Single stream: alternating pairs (ZMQ, then HTTP, then the other way round), inter-token
latency p50 of each. Many streams: alternating rounds, total output tokens per second, with
the CPU of every service process and client process over each round. The HTTP side is
``http_side`` (``/v1/completions``, token-id prompts, greedy, ``ignore_eos``, streamed); many
streams come from several client processes on both sides (``client_processes``): one process
could not read the events of 64 fast streams.
"""

from __future__ import annotations

from runtime.bench import http_side, runtime_side
from runtime.bench.client_processes import spread
from runtime.bench.measure import percentile, summarize
from runtime.bench.process_cpu import CpuWindow, describe
from runtime.bench.report import table
from runtime.bench.workloads import WARMUP_GEN, Bench, Outcome


class Http:
    """Single-stream pairs and ``streams`` concurrent requests, ZMQ client vs HTTP gateway."""

    name = "http"

    def __init__(self, bench: Bench, streams: int, prompt_len: int, gen_len: int, pairs: int) -> None:
        self.bench, self.streams, self.prompt_len, self.gen_len, self.pairs = bench, streams, prompt_len, gen_len, pairs
        self.single = [bench.prompt(prompt_len) for _ in range(2 * pairs + 2)]
        self.many = [bench.prompts(streams, prompt_len) for _ in range(6)]
        self.itl: dict[str, list[float]] = {"zmq": [], "http": []}
        self.tok_s: dict[str, list[float]] = {"zmq": [], "http": []}
        self.cpu: dict[str, list[dict[str, float]]] = {"zmq": [], "http": []}  # cores busy per role, per round

    def run(self, address: str, url: str, service_pid: int | None = None) -> Outcome:
        """``service_pid``: the ``runtime up`` process, to report its processes' CPU per round."""
        log = self.bench.log
        sides = {
            "zmq": lambda ps, gs: runtime_side.run_together(address, ps, gs),
            "http": lambda ps, gs: http_side.http_together(url, ps, gs),
        }
        # Many streams come from several client processes on both sides (client_processes).
        targets = {"zmq": address, "http": url}
        log("http: warm-up through both")
        for name, side in sides.items():
            side([self.single[0]], [WARMUP_GEN])
            spread(name, targets[name], self.many[0], [WARMUP_GEN] * self.streams)
        for i in range(self.pairs):
            order = ("zmq", "http") if i % 2 == 0 else ("http", "zmq")
            for k, name in enumerate(order):
                timing = sides[name]([self.single[2 + 2 * i + k]], [self.gen_len])[0]
                self.itl[name].append(1e3 * percentile(timing.itls(), 50))
            log(f"http: pair {i + 1}: ITL p50 zmq {self.itl['zmq'][-1]:.2f} ms, http {self.itl['http'][-1]:.2f} ms")
        for r in range(2):
            order = ("zmq", "http") if r == 0 else ("http", "zmq")
            for k, name in enumerate(order):
                # CPU per service process over the streams' span, and each client process's own.
                window = CpuWindow(service_pid) if service_pid else None
                clients: list[float] = []
                before = runtime_side.status(address)
                timings = spread(name, targets[name], self.many[2 + 2 * r + k], [self.gen_len] * self.streams,
                                 on_start=window.start if window else None, client_cores=clients)
                after = runtime_side.status(address)
                summary = summarize(timings)
                self.tok_s[name].append(summary["total_tok_s"])
                idle = runtime_side.idle_share(before, after)
                log(f"http: round {r + 1} {name}: wall {summary['wall_s']:.2f} s, TTFT p50 / p95 "
                    f"{summary['ttft_p50_ms']:.0f} / {summary['ttft_p95_ms']:.0f} ms, ITL p50 / p95 "
                    f"{summary['itl_p50_ms']:.2f} / {summary['itl_p95_ms']:.2f} ms, {after.steps - before.steps} steps, "
                    f"worker idle {100 * (idle if idle is not None else float('nan')):.1f}%")
                shares = window.stop().shares() if window is not None else {}
                if clients:
                    shares["client (busiest)"] = max(clients)
                self.cpu[name].append(shares)
                log(f"http: round {r + 1} {name}: {describe(shares)}")
            log(f"http: {self.streams} streams round {r + 1}: zmq {self.tok_s['zmq'][-1]:.1f} tok/s, "
                f"http {self.tok_s['http'][-1]:.1f} tok/s")
        return self.outcome()

    def outcome(self) -> Outcome:
        itl_ratios = sorted(h / z for z, h in zip(self.itl["zmq"], self.itl["http"]))
        thr_ratios = sorted(h / z for z, h in zip(self.tok_s["zmq"], self.tok_s["http"]))
        med = itl_ratios[len(itl_ratios) // 2]
        rows = [
            ["single stream ITL p50, ms (median of pairs)", _median(self.itl["zmq"]), _median(self.itl["http"]),
             f"{med:.3f}", "at most 1.05"],
            [f"{self.streams} streams, tok/s (median of rounds; ratio: median of per-round ratios)",
             _median(self.tok_s["zmq"]), _median(self.tok_s["http"]), f"{percentile(thr_ratios, 50):.3f}", "at least 0.9"],
        ]
        data = {"itl_ms": self.itl, "tok_s": self.tok_s, "itl_ratio_median": med, "throughput_ratios": thr_ratios,
                "cpu_cores": self.cpu}
        title = f"HTTP gateway vs ZMQ client (prompt {self.prompt_len}, {self.gen_len} new tokens, greedy)"
        tables = [table(title, ["measure", "zmq", "http", "http/zmq", "target"], rows)]
        roles = sorted({role for side in self.cpu.values() for shares in side for role in shares})
        if roles:  # which process would saturate a core first
            cpu_rows = [[role] + [_median([s.get(role, 0.0) for s in self.cpu[side]]) for side in ("zmq", "http")]
                        for role in roles]
            tables.append(table(f"CPU cores busy per process during the {self.streams}-stream rounds (median)",
                                ["process", "zmq", "http"], cpu_rows))
        return Outcome(data, tables)


def _median(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[len(ordered) // 2] if ordered else float("nan")
