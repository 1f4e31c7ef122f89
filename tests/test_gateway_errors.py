"""HTTP statuses of the gateway's failures, on the real `runtime up` driven by the openai package.

The worker is frozen (SIGSTOP) to hold requests in place, killed (SIGKILL) to fail them, and kept
from loading (its weights hidden) to hold the service in "restarting"; no test waits on a sleep.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import openai
import pytest
from conftest import running_config
from test_gateway import START_TIMEOUT_S, Gateway, _free_port, _wait_for_line

from runtime.client import SyncClient
from runtime.protocol import client as cp

WAIT_S = 30.0


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    """One request runs at a time and one may wait; the model folder is a copy, so its weights can be hidden."""
    source = model_dir("llama")
    root = tmp_path_factory.mktemp("gateway-errors")
    folder = root / source.name
    shutil.copytree(source, folder)
    port = _free_port()
    config = root / "service.toml"
    config.write_text(
        f'[model]\npath = "{folder}"\n[server]\naddress = "ipc://"\n'
        "[scheduler]\nmax_running = 1\nmax_waiting = 1\nmax_context = 256\n[cache]\nkv_slots = 1024\n"
        f'[http]\naddress = "127.0.0.1:{port}"\n'
    )
    with running_config(config, timeout=START_TIMEOUT_S) as svc:
        _wait_for_line(svc, "HTTP on")
        yield Gateway(svc, port, folder)


def _status(gw: Gateway) -> cp.StatusReply:
    with SyncClient(gw.svc.address, timeout_s=10) as client:
        return client.status()


def _until(gw: Gateway, check, what: str, timeout: float = WAIT_S) -> cp.StatusReply:
    """Poll the scheduler's status until ``check(status)``; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        status = _status(gw)
        if check(status):
            return status
        assert time.monotonic() < deadline, f"{what} not reached within {timeout} s: {status}\n{gw.svc.log()}"
        time.sleep(0.02)  # polling, bounded by the deadline


def _health(gw: Gateway) -> httpx.Response:
    return httpx.get(f"{gw.base}/health", timeout=10)


def _serving(gw: Gateway) -> cp.StatusReply:
    """Wait until the worker serves, nothing runs or waits, and /health says so."""
    status = _until(gw, lambda s: s.worker_state == "up" and s.running == 0 and s.waiting == 0, "an idle worker",
                    timeout=60)
    assert _health(gw).status_code == 200
    return status


@contextmanager
def _frozen(pid: int):
    """The worker stopped (SIGSTOP): its steps stay in flight until it is continued."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass  # killed while frozen


def _complete(gw: Gateway, prompt: list[int], max_tokens: int = 4):
    return gw.openai().completions.create(model=gw.folder.name, prompt=prompt, max_tokens=max_tokens,
                                          temperature=0, extra_body={"ignore_eos": True})


def test_a_full_waiting_queue_answers_429(gateway):
    pid = _serving(gateway).worker_pid
    with ThreadPoolExecutor(2) as pool, _frozen(pid):
        running = pool.submit(_complete, gateway, [5, 6, 7])
        _until(gateway, lambda s: s.running == 1, "one running request")
        waiting = pool.submit(_complete, gateway, [5, 6, 8])
        _until(gateway, lambda s: s.waiting == 1, "one waiting request")
        with pytest.raises(openai.RateLimitError) as refused:
            _complete(gateway, [5, 6, 9])
        assert not running.done() and not waiting.done()
    assert refused.value.status_code == 429 and refused.value.code == "overloaded"
    assert "overloaded" in refused.value.body["message"] and "max_waiting" in refused.value.body["message"]
    assert refused.value.body["type"] == "rate_limit_error"
    # Once the worker runs again, both queued requests are served.
    assert [r.result(WAIT_S).usage.completion_tokens for r in (running, waiting)] == [4, 4]


@pytest.mark.parametrize("stream", [False, True])
def test_a_worker_dying_under_a_request_answers_500_with_the_reason(gateway, stream):
    pid = _serving(gateway).worker_pid
    client = gateway.openai()

    def complete():
        reply = client.completions.create(model=gateway.folder.name, prompt=[5, 6, 7], max_tokens=4, stream=stream)
        return list(reply) if stream else reply

    with ThreadPoolExecutor(1) as pool, _frozen(pid):
        call = pool.submit(complete)
        _until(gateway, lambda s: s.running == 1, "one running request")
        os.kill(pid, signal.SIGKILL)  # before its first token: the HTTP status can still say so
        with pytest.raises(openai.InternalServerError) as failed:
            call.result(WAIT_S)
    assert failed.value.status_code == 500 and failed.value.code == "worker_failed"
    assert failed.value.body["message"].startswith("worker died (exit status -9)")
    after = _serving(gateway)
    assert after.worker_pid != pid
    assert _complete(gateway, [5, 6, 7]).usage.completion_tokens == 4


def test_health_and_completions_answer_503_while_the_worker_restarts(gateway):
    pid = _serving(gateway).worker_pid
    weights = sorted(gateway.folder.glob("*.safetensors"))
    assert weights
    hidden = [w.with_name(w.name + ".hidden") for w in weights]
    try:
        for w, h in zip(weights, hidden):  # no worker can load the model until they are back
            w.rename(h)
        os.kill(pid, signal.SIGKILL)
        _until(gateway, lambda s: s.worker_state == "restarting", "a restarting worker")
        health = _health(gateway)
        assert health.status_code == 503 and health.json() == {"status": "unavailable", "scheduler": "restarting"}
        with pytest.raises(openai.APIStatusError) as refused:
            _complete(gateway, [5, 6, 7])
        assert _status(gateway).worker_state == "restarting"  # still down: the answers above were given then
    finally:
        for w, h in zip(weights, hidden):
            h.rename(w)
    assert refused.value.status_code == 503 and refused.value.code == "unavailable"
    assert refused.value.body["message"].startswith("worker unavailable, retrying")
    assert refused.value.body["type"] == "service_unavailable"
    # The next attempt loads the model again (after the supervisor's backoff) and the service serves.
    assert _serving(gateway).worker_restarts >= 2
    assert _complete(gateway, [5, 6, 7]).usage.completion_tokens == 4


def test_a_worker_dying_mid_response_stream_ends_it_with_response_failed(gateway):
    pid = _serving(gateway).worker_pid
    body = {"model": gateway.folder.name, "input": "hello", "max_output_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True}
    types, last = [], None
    with httpx.stream("POST", f"{gateway.base}/v1/responses", json=body, timeout=WAIT_S) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if not line.startswith("data: "):
                continue
            last = json.loads(line.removeprefix("data: "))
            types.append(last["type"])
            if last["type"] == "response.output_text.delta" and types.count(last["type"]) == 1:
                os.kill(pid, signal.SIGSTOP)  # mid-reply: held, then killed
                os.kill(pid, signal.SIGKILL)
    assert types[:2] == ["response.created", "response.in_progress"] and "response.output_text.delta" in types
    assert last["type"] == "response.failed" and last["response"]["status"] == "failed"
    assert last["response"]["error"]["message"].startswith("worker died (exit status -9)")
    assert last["response"]["output"][0]["type"] == "message"  # what it had written is kept
    assert _serving(gateway).worker_pid != pid
