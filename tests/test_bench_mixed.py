"""The ``mixed`` (open-loop HTTP, runtime gateway vs mlx_lm.server) and ``long`` bench workloads."""

from __future__ import annotations

import dataclasses
import json
import math
import os
import random
import statistics
from pathlib import Path

import pytest

from runtime.bench.long_prompt import first_difference
from runtime.bench.main import build_parser, run
from runtime.bench.mixed import (
    PROMPT_MIN,
    SUFFIX,
    MixedShape,
    arrivals,
    prompt_lengths,
    schedule,
)
from runtime.bench.mlx_server import MlxServer, free_port
from runtime.bench.open_loop import Request, RequestTiming, run_schedule, short_replies, summarize_open
from runtime.bench.sse_load import last_finish_reason
from runtime.bench.service import ServiceError

SHAPE = MixedShape(requests=40, rate=30.0, prompt_median=100, prompt_max=300, gen=(4, 9), prefix_requests=6,
                   prefix_len=200)


def _processes_mentioning(text: str) -> list[str]:
    """Command lines of live processes that contain ``text`` (Linux /proc)."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if text in cmd:
                found.append(cmd)
    return found


def test_same_seed_same_schedule_and_another_seed_another():
    a, b = schedule(random.Random(7), SHAPE), schedule(random.Random(7), SHAPE)
    assert a == b
    assert schedule(random.Random(8), SHAPE) != a


def test_schedule_shape_and_bounds():
    draws = schedule(random.Random(0), SHAPE)
    main, wave = draws[: SHAPE.requests], draws[SHAPE.requests:]
    assert len(main) == SHAPE.requests and len(wave) == SHAPE.prefix_requests
    assert {d.wave for d in main} == {"main"} and {d.wave for d in wave} == {"prefix"}
    times = [d.at for d in draws]
    assert times == sorted(times) and times[0] > 0  # the wave continues the same arrival process
    assert all(PROMPT_MIN <= d.prompt_len <= SHAPE.prompt_max for d in main)
    assert all(SHAPE.prefix_len + SUFFIX[0] <= d.prompt_len <= SHAPE.prefix_len + SUFFIX[1] for d in wave)
    assert all(SHAPE.gen[0] <= d.max_tokens <= SHAPE.gen[1] for d in draws)
    longer = dataclasses.replace(SHAPE, suffix=(100, 300))  # --mixed-prefix-suffix 100,300
    wave = schedule(random.Random(0), longer)[SHAPE.requests:]
    lens = [d.prompt_len - SHAPE.prefix_len for d in wave]
    assert all(100 <= n <= 300 for n in lens) and max(lens) > SUFFIX[1]


def test_poisson_rate_and_lognormal_median():
    rng = random.Random(1)
    times = arrivals(rng, 6000, rate=30.0)
    assert times[-1] / 6000 == pytest.approx(1 / 30, rel=0.05)  # mean gap 1/rate
    lens = prompt_lengths(rng, 4001, median=400, lo=16, hi=3000)
    assert min(lens) >= 16 and max(lens) <= 3000
    assert statistics.median(lens) == pytest.approx(400, rel=0.08)
    clipped = prompt_lengths(rng, 500, median=400, lo=300, hi=500)
    assert min(clipped) == 300 and max(clipped) == 500  # both ends clip


def _timing(due: float, send: float, first: float, last: float, tokens: int, cached: int | None = None,
            error: str | None = None) -> RequestTiming:
    return RequestTiming(due=due, send=send, first=first, last=last, tokens=tokens, cached_tokens=cached, error=error)


def test_open_loop_summary_math():
    timings = [
        _timing(0.0, 0.0, 0.1, 0.5, 5, cached=3),  # TTFT 0.1 s, TPOT 0.1 s: too slow per token
        _timing(1.0, 1.0, 2.5, 2.6, 3, cached=0),  # TTFT 1.5 s: too late; TPOT 0.05 s
        _timing(0.2, 0.21, 0.3, 0.3, 1),  # one token: no TPOT, judged on TTFT alone: good
        _timing(0.4, 0.4, math.nan, math.nan, 0, error="HTTP 500: boom"),
    ]
    assert timings[0].tpot == pytest.approx(0.1) and timings[2].tpot is None
    s = summarize_open(timings, start=0.0, ttft_slo_s=1.0, tpot_slo_s=0.08)
    assert (s["requests"], s["completed"], s["failed"], s["errors"]) == (4, 3, 1, ["HTTP 500: boom"])
    assert s["output_tokens"] == 9 and s["wall_s"] == pytest.approx(2.6)
    assert s["throughput_tok_s"] == pytest.approx(9 / 2.6)
    assert s["ttft_p50_ms"] == pytest.approx(100.0) and s["ttft_p99_ms"] == pytest.approx(1e3 * (0.1 + 1.4 * 0.98))
    assert s["tpot_p50_ms"] == pytest.approx(75.0) and s["tpot_p99_ms"] == pytest.approx(99.5)
    assert s["goodput"] == pytest.approx(1 / 4)  # the failed request counts against it
    assert s["cached_tokens"] == 3 and s["send_lag_max_ms"] == pytest.approx(10.0)
    assert summarize_open(timings, 0.0, ttft_slo_s=2.0, tpot_slo_s=0.2)["goodput"] == pytest.approx(3 / 4)


def test_the_prefix_wave_is_split_by_cache_hits_and_each_request_is_kept():
    from runtime.bench.open_loop import cache_split, per_request

    timings = [
        _timing(0.0, 0.0, 0.1, 0.5, 5, cached=64),    # a hit, TTFT 100 ms
        _timing(1.0, 1.0, 1.3, 1.5, 3, cached=128),   # a hit, TTFT 300 ms
        _timing(2.0, 2.0, 4.0, 4.1, 2, cached=0),     # a miss, TTFT 2 s
        _timing(3.0, 3.0, math.nan, math.nan, 0, error="HTTP 500: boom"),  # failed: neither
    ]
    assert cache_split(timings) == {"hits": 2, "misses": 1, "hit_ttft_p50_ms": pytest.approx(200.0),
                                    "miss_ttft_p50_ms": pytest.approx(2000.0)}
    assert cache_split([_timing(0.0, 0.0, 0.1, 0.2, 2)]) == {}  # no reply said what it read
    rows = per_request(timings, ["main", "main", "prefix", "prefix"], start=-0.5)
    assert rows[0] == [0.5, "main", 100.0, 100.0, 64, 5]
    assert rows[3] == [3.5, "prefix", None, None, None, 0]


def test_replies_short_of_max_tokens_are_counted_by_finish_reason():
    timings = [RequestTiming(due=0.0, tokens=8, asked=8, finish="length", counted=True),
               RequestTiming(due=0.0, tokens=3, asked=8, finish="stop", counted=True),
               RequestTiming(due=0.0, tokens=5, asked=9, finish=None, counted=False)]
    assert short_replies(timings) == {"count": 2, "tokens_short": 9, "finish_reasons": {"stop": 1, "None": 1},
                                      "without_usage": 1}
    events = (b'data: {"choices": [{"text": "a", "finish_reason": null}]}\n\n'
              b'data: {"choices":[{"text":"","finish_reason":"length"}]}\n\n')
    assert last_finish_reason(events) == "length" and last_finish_reason(events[:50]) is None


def test_requests_that_fail_are_counted_and_reported():
    url = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    start, timings = run_schedule(url, [Request(0.0, "t1 t2", 4), Request(0.05, "t3", 4)])
    assert all(t.error and "Connect" in t.error for t in timings)
    assert timings[1].send - timings[0].send >= 0.04  # sent on schedule, not together
    s = summarize_open(timings, start, ttft_slo_s=1.0, tpot_slo_s=0.05)
    assert (s["completed"], s["failed"], s["goodput"], s["output_tokens"]) == (0, 2, 0.0, 0)
    assert s["errors"] and math.isnan(s["throughput_tok_s"])


def _sse_server(events: list[bytes]):
    """A server on a free port that answers every POST with ``events`` and closes; its url."""
    import socket
    import threading

    sock = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = sock.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\n\r\n" + b"".join(events))

    threading.Thread(target=serve, daemon=True).start()
    return sock, f"http://127.0.0.1:{sock.getsockname()[1]}"


def test_a_stream_cut_without_a_finish_counts_as_failed():
    text = b'data: {"choices": [{"text": "t1 ", "finish_reason": null}]}\n\n'
    end = (b'data: {"choices": [{"text": "", "finish_reason": "length"}]}\n\n'
           b'data: {"choices": [], "usage": {"completion_tokens": 3}}\n\ndata: [DONE]\n\n')
    for events, failed in (([text] * 3, True), ([text] * 3 + [end], False)):
        sock, url = _sse_server(events)
        try:
            _, (timing,) = run_schedule(url, [Request(0.0, "t1", 3)])
        finally:
            sock.close()
        assert (timing.error is not None) == failed, timing.error
        if failed:
            assert "without a finish" in timing.error
        else:
            assert (timing.tokens, timing.finish, timing.counted) == (3, "length", True)


def test_mlx_server_keeps_its_first_traceback_past_the_tail(tmp_path):
    import subprocess
    import sys

    script = ("print('Traceback (most recent call last):'); print('  File x'); print('ValueError: first');"
              "[print('Traceback (most recent call last):') or print('RuntimeError: later') for _ in range(300)]")
    server = MlxServer(tmp_path, 1)
    server.proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    server._drain()
    server.proc.wait()
    assert server.error().splitlines()[:3] == ["Traceback (most recent call last):", "  File x", "ValueError: first"]
    assert "ValueError: first" not in server.log()  # pushed out of the last lines


def test_first_difference():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2


def test_mlx_server_that_cannot_load_reports_its_output_and_leaves_nothing(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama"}))  # no weights
    with pytest.raises(ServiceError, match="No safetensors"), MlxServer(tmp_path, 4, startup_timeout_s=60):
        pass
    assert _processes_mentioning(str(tmp_path)) == []


@pytest.mark.parametrize("stop_at_eos", [False, True])
def test_both_sides_are_asked_for_the_same_work_unless_replies_stop_at_eos(tmp_path, monkeypatch, stop_at_eos):
    from runtime.bench import open_loop, sse_load
    from runtime.bench.mixed import Mixed
    from runtime.bench.models import model_vocab, synthetic_model
    from runtime.bench.workloads import Bench

    folder = synthetic_model("tiny", tmp_path)
    vocab, eos_ids = model_vocab(folder)
    bench = Bench(model=folder, vocab_size=vocab, eos_ids=eos_ids, seed=0, log=lambda _: None)
    shape = MixedShape(requests=3, rate=50.0, prompt_median=20, prompt_max=40, gen=(4, 6), prefix_requests=1,
                       prefix_len=24, stop_at_eos=stop_at_eos)
    plan = Mixed(bench, shape)
    banned = None if stop_at_eos else {str(e): -100.0 for e in eos_ids}
    assert eos_ids and all(r.logit_bias == banned for r in plan.requests + plan.warm)
    bodies = []

    async def stream(url, path, body, on_events, timeout):
        bodies.append(body)
        return {"completion_tokens": body["max_tokens"]}

    monkeypatch.setattr(sse_load, "stream", stream)
    open_loop.run_schedule("http://unused", plan.requests[:2])
    assert [b.get("logit_bias") for b in bodies] == [banned, banned]


def test_mixed_and_long_workloads_run_both_sides(tmp_path, capsys):
    out = tmp_path / "bench.json"
    args = build_parser().parse_args([
        "--synthetic", "tiny", "--work-dir", str(tmp_path), "--workloads", "mixed,long", "--blas", "bundled",
        "--mixed-requests", "8", "--mixed-rate", "20", "--mixed-prompt-median", "32", "--mixed-prompt-max", "64",
        "--mixed-gen", "4,8", "--mixed-prefix-requests", "3", "--mixed-prefix-len", "48",
        "--long-lens", "256", "--long-gen", "8", "--http-port", str(free_port()), "--json", str(out),
    ])
    assert args.max_step_tokens == 0 and args.prefill_chunk == 0  # the service's own defaults
    assert run(args) == 0
    data = json.loads(out.read_text())
    mixed = data["workloads"]["mixed"]
    assert mixed["requests"] == 11 and mixed["waves"] == {"main": 8, "prefix": 3}
    for side in ("runtime", "mlx_lm"):
        st = mixed[side]
        assert (st["requests"], st["completed"], st["failed"]) == (11, 11, 0), st["errors"]
        assert st["throughput_tok_s"] > 0 and st["output_tokens"] >= 11
        assert st["ttft_p50_ms"] > 0 and st["ttft_p99_ms"] >= st["ttft_p50_ms"]
        assert 0 <= st["goodput"] <= 1 and st["prefix_wave"]["requests"] == 3
    assert mixed["runtime"]["prefix_wave"]["cached_tokens"] > 0
    cache = mixed["runtime"]["prefix_wave"]["cache"]
    assert cache["hits"] >= 1 and cache["hits"] + cache["misses"] == 3
    rows = mixed["runtime"]["per_request"]
    assert len(rows) == 11 and [r[1] for r in rows] == ["main"] * 8 + ["prefix"] * 3
    assert all(r[2] > 0 and r[5] >= 1 for r in rows)
    # EOS banned on both sides: the same work, every reply its max_tokens.
    assert mixed["runtime"]["output_tokens"] == mixed["mlx_lm"]["output_tokens"]
    if os.path.isdir("/proc"):  # CPU per process over each side's schedule (read from /proc)
        cpu = mixed["cpu_cores"]
        assert set(cpu) == {"runtime", "mlx_lm"}
        assert {"scheduler", "worker", "gateway", "bench client"} <= set(cpu["runtime"])
        assert cpu["runtime"]["worker"] > 0 and cpu["mlx_lm"]["server"] > 0
    shapes = mixed["runtime_shapes"]
    assert shapes["prefill_shapes_warm"] >= 1 and shapes["prefill_shapes_new"] >= 1  # CPU: no length buckets
    assert mixed["ratios"]["throughput_tok_s_runtime_over_mlx"] > 0
    assert mixed["ratios"]["ttft_p99_ms_runtime_over_mlx"] > 0
    assert data["services"]["mixed"]["max_step_tokens"] == 0 and data["services"]["mixed"]["prefill_chunk"] == 0
    assert data["services"]["mixed"]["max_running"] == 0  # the service's own default for its device
    long = data["workloads"]["long"]["results"]
    assert [r["prompt_len"] for r in long] == [256]
    for side in ("runtime", "mlx_lm"):
        assert long[0][side]["output_tokens"] == 8 and long[0][side]["decode_tok_s"] > 0
    assert long[0]["tokens_match"] is True and long[0]["first_difference"] is None
    assert long[0]["first_difference_logprob_gap"] is None
    text = capsys.readouterr().out
    assert "new prefill shapes / decode traces per 1,000 requests" in text
    assert "mixed load over HTTP" in text and "long prompts, one at a time" in text
    assert "EOS banned" in text
    assert _processes_mentioning(str(tmp_path)) == []  # the service and mlx_lm.server are gone


def test_long_reports_mlx_lms_own_gap_at_the_first_difference():
    from runtime.bench.long_prompt import LongPrompt
    from runtime.bench.measure import StreamTiming
    from runtime.bench.workloads import Bench

    bench = Bench(model=None, vocab_size=50, eos_ids={49}, seed=0, log=lambda _: None)
    plan = LongPrompt(bench, [16], gen_len=4)

    def timing(ids: list[int]) -> StreamTiming:
        t = StreamTiming(start=0.0)
        for k, i in enumerate(ids):
            t.add([i], at=0.1 * (k + 1))
        return t

    plan.rt[16].append(timing([1, 2, 3, 4]))

    class FakeMlx:
        asked: list = []

        def single(self, prompt, gen_len):
            return timing([1, 2, 9, 9][:gen_len])

        def logprob_gap(self, context, mlx_token, runtime_token):
            self.asked.append((len(context), mlx_token, runtime_token))
            return 0.03

    fake = FakeMlx()
    plan.run_mlx(fake, 0)
    assert fake.asked == [(16 + 2, 9, 3)]  # the prompt and the agreed tokens, then the two choices
    outcome = plan.outcome()
    result = outcome.data["results"][0]
    assert result["first_difference"] == 2 and result["first_difference_logprob_gap"] == 0.03
    assert "near-tie" in outcome.warnings[0] and "0.03 nats" in outcome.tables[0]


def test_long_warm_runs_a_prompt_of_every_length_on_both_sides_first(monkeypatch):
    from runtime.bench import long_prompt
    from runtime.bench.long_prompt import LongPrompt
    from runtime.bench.measure import StreamTiming
    from runtime.bench.workloads import Bench

    def timing(n: int) -> StreamTiming:
        t = StreamTiming(start=0.0)
        for k in range(n):
            t.add([k + 1], at=0.1 * (k + 1))
        return t

    bench = Bench(model=None, vocab_size=50, eos_ids={49}, seed=0, log=lambda _: None)
    runtime_calls, mlx_calls = [], []
    monkeypatch.setattr(long_prompt.runtime_side, "run_together",
                        lambda address, prompts, gens: runtime_calls.append(len(prompts[0])) or [timing(gens[0])])

    class FakeMlx:
        def single(self, prompt, gen_len):
            mlx_calls.append(len(prompt))
            return timing(gen_len)

    for warm, want in ((False, [64, 16, 32]), (True, [64, 16, 32, 16, 32])):
        runtime_calls.clear(), mlx_calls.clear()
        plan = LongPrompt(bench, [16, 32], gen_len=4, warm_lengths=warm)
        plan.run_runtime({"on": "ipc://unused"}, 0)
        plan.run_mlx(FakeMlx(), 0)
        assert runtime_calls == want and mlx_calls == want  # the short warm-up, [every length,] the timed ones
        assert plan.warm_long == [] if not warm else [len(p) for p in plan.warm_long] == [16, 32]
        assert plan.prompts[16][0] not in plan.warm_long  # other tokens: no prefix-cache hit on the timed one
        outcome = plan.outcome()
        assert outcome.data["warm_lengths"] is warm
        assert ("after a warm-up prompt of every length" in outcome.tables[0]) is warm


def test_gpu_watch_keeps_each_process_peak_and_names_the_others():
    from runtime.bench.gpu_watch import GpuWatch

    samples = iter([{10: 2 * 2**30, 11: 1 * 2**30}, {10: 5 * 2**30, 12: 3 * 2**30}, {10: 1 * 2**30}])
    watch = GpuWatch(period_s=0.0, sample=lambda: next(samples, None))
    with watch:
        pass
    assert watch._thread is not None and not watch._thread.is_alive()
    assert watch.samples == 3 and watch.peaks == {10: 5 * 2**30, 11: 2**30, 12: 3 * 2**30}
    assert watch.peak_total == 8 * 2**30
    line = watch.summary({"server": 10})
    assert line.startswith("peak GPU memory over 3 samples: server 5.0 GiB, others pid 11 1.0 GiB, pid 12 3.0 GiB")
    assert line.endswith("(all processes together at most 8.0 GiB)")
    assert GpuWatch(sample=lambda: None).summary({"server": 10}) == ""


def test_a_server_out_of_device_memory_gets_a_hint_to_lower_its_concurrency():
    from runtime.bench.phases import server_hint

    oom = "RuntimeError: cudaMallocAsync(&data, size, stream) failed: out of memory"
    assert "--mlx-server-concurrency 32" in server_hint(oom, 128)
    assert server_hint(oom, 32) is None  # already at its own default
    assert server_hint("RuntimeError: generation thread died", 128) is None


def test_the_prefix_wave_row_names_hits_and_misses_with_their_ttft():
    from runtime.bench.mixed import _hits

    assert _hits({}) == "-"
    assert _hits({"hits": 14, "misses": 2, "hit_ttft_p50_ms": 294.2, "miss_ttft_p50_ms": 707.0}) == "14 (294) / 2 (707)"
    assert _hits({"hits": 0, "misses": 16, "hit_ttft_p50_ms": math.nan, "miss_ttft_p50_ms": 1285.9}) == "0 / 16 (1286)"
