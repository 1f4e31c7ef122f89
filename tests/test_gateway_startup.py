"""The HTTP gateway answers while the worker is still loading: ``starting``, at once, not a hang.

The real `runtime up`: its worker is frozen (SIGSTOP) as soon as it is launched, which holds
the service in its start-up for as long as the test needs; then it is let go.
"""

from __future__ import annotations

import os
import signal
import time

import httpx
import pytest
from conftest import Service, kill_group, start_runtime, stop_runtime, worker_pid
from test_gateway import _config, _free_port, _wait_for_line

WAIT_S = 60.0
ANSWER_S = 5.0  # a starting gateway answers within this; the worker stays frozen far longer


def _first_answer(url: str) -> httpx.Response:
    """The first HTTP answer from ``url`` (the port listens from the start; the gateway process
    takes a moment to accept)."""
    deadline = time.monotonic() + WAIT_S
    while True:
        try:
            return httpx.get(url, timeout=ANSWER_S)
        except httpx.TransportError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)  # the gateway process is still importing, bounded by the deadline


def test_http_answers_starting_until_the_worker_is_ready(model_dir, tmp_path):
    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    proc, _, lines = start_runtime(_config(tmp_path, model_dir("llama"), port))
    svc = Service(proc=proc, address="", lines=lines)
    try:
        worker = worker_pid(proc)
        os.kill(worker, signal.SIGSTOP)
        try:
            health = _first_answer(base + "/health")
            assert health.status_code == 503 and health.json()["status"] == "starting"
            started = time.monotonic()
            completion = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2},
                                    timeout=ANSWER_S)
            models = httpx.get(base + "/v1/models", timeout=ANSWER_S)
            assert time.monotonic() - started < ANSWER_S  # answered, not held until the model loads
            for reply in (completion, models):
                assert reply.status_code == 503, reply.text
                error = reply.json()["error"]
                assert error["code"] == "starting" and "still loading the model" in error["message"]
            assert httpx.get(base + "/metrics", timeout=ANSWER_S).status_code == 200
            assert not any("serving" in line or "HTTP on" in line for line in list(lines))  # still starting
        finally:
            os.kill(worker, signal.SIGCONT)
        _wait_for_line(svc, "HTTP on")  # printed once /health answers 200
        assert httpx.get(base + "/health", timeout=ANSWER_S).json() == {"status": "ok"}
        reply = httpx.post(base + "/v1/completions", json={"prompt": "hi", "max_tokens": 2, "temperature": 0},
                           timeout=WAIT_S)
        assert reply.status_code == 200 and reply.json()["usage"]["completion_tokens"] >= 1
    finally:
        stop_runtime(proc, timeout=15)
    assert proc.returncode == 0, svc.log()
    assert "runtime: stopped" in svc.log()


def test_sigterm_while_starting_stops_the_gateway_too(model_dir, tmp_path):
    port = _free_port()
    proc, _, lines = start_runtime(_config(tmp_path, model_dir("llama"), port))
    try:
        worker = worker_pid(proc)
        os.kill(worker, signal.SIGSTOP)
        assert _first_answer(f"http://127.0.0.1:{port}/health").status_code == 503
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=10)  # the README's promise: within 10 s, also while starting
        assert proc.returncode == 0 and "stopped during start-up" in "".join(lines)
        with pytest.raises(httpx.TransportError):  # nothing serves the port any more
            httpx.get(f"http://127.0.0.1:{port}/health", timeout=2)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        kill_group(proc)
