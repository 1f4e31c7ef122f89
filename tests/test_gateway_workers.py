"""Several gateway processes (``[http] workers``) on one socket: every process serves, the
metrics of all of them are summed at each scrape, and none is left after SIGTERM."""

from __future__ import annotations

import os
import signal
import subprocess

import httpx
import pytest
from model_factory import reference_greedy
from test_gateway import GREEDY, _decode, _metric, gateway_service


def _gateway_pids(runtime_pid: int) -> list[int]:
    children = subprocess.run(["pgrep", "-P", str(runtime_pid)], capture_output=True, text=True).stdout.split()
    out = []
    for pid in children:
        cmdline = open(f"/proc/{pid}/cmdline", "rb").read().replace(b"\0", b" ").decode()
        if "runtime.gateway.main" in cmdline:
            out.append(int(pid))
    return out


def test_two_gateway_processes_serve_and_sum_their_metrics(model_dir, tmp_path):
    folder = model_dir("llama")
    with gateway_service(tmp_path, folder, "workers = 2") as gw:
        gateways = _gateway_pids(gw.svc.proc.pid)
        assert len(gateways) == 2
        prompt = [5, 17, 42, 9]
        expected = reference_greedy(folder, prompt, 4)
        texts = set()
        requests = 12
        for _ in range(requests):  # a new connection each: the kernel hands them to either process
            with httpx.Client(timeout=60) as client:
                body = {"model": folder.name, "prompt": prompt, "max_tokens": 4, "temperature": 0,
                        "ignore_eos": True}
                reply = client.post(f"{gw.base}/v1/completions", json=body).json()
            assert reply["usage"]["completion_tokens"] == 4
            texts.add(reply["choices"][0]["text"])
        via_sdk = gw.openai().completions.create(model=folder.name, prompt=prompt, max_tokens=4, **GREEDY)
        assert texts == {via_sdk.choices[0].text} and via_sdk.usage.completion_tokens == 4
        assert via_sdk.choices[0].text == _decode(folder, expected)
        scrapes = [httpx.get(f"{gw.base}/metrics", timeout=10).text for _ in range(6)]
        for text in scrapes:  # whichever process answers, it counts every process's requests
            assert _metric(text, "runtime_generation_tokens_total{") == 4 * (requests + 1)
            assert _metric(text, 'runtime_requests_total{finish_reason="length"') == requests + 1
            assert _metric(text, "runtime_time_to_first_token_seconds_count{") == requests + 1
            assert 0.0 < _metric(text, "runtime_prefix_cache_hit_ratio{") < 1.0  # repeats hit the radix cache
        gw.svc.proc.send_signal(signal.SIGTERM)
        gw.svc.proc.wait(timeout=15)
    for pid in gateways:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_sigint_stops_every_gateway_process(model_dir, tmp_path):
    with gateway_service(tmp_path, model_dir("llama"), "workers = 3") as gw:
        gateways = _gateway_pids(gw.svc.proc.pid)
        assert len(gateways) == 3
        assert httpx.get(f"{gw.base}/health", timeout=10).status_code == 200
        gw.svc.proc.send_signal(signal.SIGINT)
        gw.svc.proc.wait(timeout=15)
    for pid in gateways:
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)


def test_workers_out_of_range_is_a_config_error():
    from runtime.config import ConfigError, parse_config

    for workers in (0, 65):
        with pytest.raises(ConfigError, match="http.workers"):
            parse_config({"model": {"path": "/x"}, "http": {"workers": workers}})
