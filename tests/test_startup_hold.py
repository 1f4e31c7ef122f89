"""Client messages while the worker starts: status answers "starting", requests wait and then run.

Unit tests drive ``StartupHold`` with a recording stand-in for the client socket's sender; the
service test freezes a real `runtime up`'s worker (SIGSTOP) as soon as it is launched.
"""

from __future__ import annotations

import os
import signal
import subprocess
import threading

import msgspec
from conftest import Service, kill_group, start_runtime
from model_factory import reference_greedy
from test_gateway_startup import _worker_of

from runtime.client import SyncClient
from runtime.config import parse_config
from runtime.protocol import client as cp
from runtime.scheduler.startup_hold import StartupHold

TIMEOUT_S = 60.0


class Recorder:
    """Stands in for ``ClientOut``: what would have been sent, per connection identity."""

    def __init__(self) -> None:
        self.sent: list[tuple[bytes, msgspec.Struct]] = []

    def reply_raw(self, identity: bytes, envelope: tuple[bytes, ...], msg: msgspec.Struct) -> None:
        self.sent.append((identity, msg))


def _frames(identity: bytes, msg: msgspec.Struct) -> list[bytes]:
    return [identity, cp.client_encoder.encode(msg)]


def _hold(max_waiting: int = 2) -> tuple[StartupHold, Recorder]:
    config = parse_config({"model": {"path": "/m"}, "scheduler": {"max_waiting": max_waiting, "max_context": 512}})
    out = Recorder()
    return StartupHold(config, out, worker_pid=4321), out


def test_status_is_answered_at_once_and_everything_else_is_held_in_order():
    hold, out = _hold()
    first = _frames(b"a", cp.Generate(rid="g1", token_ids=[1, 2], max_tokens=3))
    abort = _frames(b"a", cp.Abort(rid="g1"))
    junk = [b"b", b"\xc1 not msgpack"]
    for frames in (first, abort, junk):
        hold.on_frames(frames)
    hold.on_frames(_frames(b"c", cp.StatusQuery(rid="s1")))
    assert len(out.sent) == 1  # only the status query was answered
    identity, status = out.sent[0]
    assert identity == b"c" and isinstance(status, cp.StatusReply)
    assert (status.rid, status.worker_state, status.waiting, status.worker_pid) == ("s1", "starting", 1, 4321)
    assert status.max_context == 512 and status.model == "/m"
    assert hold.take() == [first, abort, junk]  # replayed in arrival order, malformed ones too
    assert hold.take() == []


def test_past_max_waiting_a_request_is_refused_at_once():
    hold, out = _hold(max_waiting=2)
    for i in range(3):
        hold.on_frames(_frames(b"a", cp.Generate(rid=f"g{i}", token_ids=[1], max_tokens=1)))
    assert len(hold.held) == 2
    (identity, done), = out.sent
    assert identity == b"a" and isinstance(done, cp.Done) and done.rid == "g2"
    assert done.finish_reason == "error" and done.error.startswith("overloaded")


def test_a_worker_that_never_starts_fails_every_held_request():
    hold, out = _hold()
    hold.on_frames(_frames(b"a", cp.Generate(rid="g1", token_ids=[1], max_tokens=1)))
    hold.on_frames(_frames(b"b", cp.Generate(rid="g2", token_ids=[1], max_tokens=1)))
    hold.fail_all("worker unavailable: the worker could not start (boom)")
    assert [(i, m.rid, m.finish_reason, m.error) for i, m in out.sent] == [
        (b"a", "g1", "error", "worker unavailable: the worker could not start (boom)"),
        (b"b", "g2", "error", "worker unavailable: the worker could not start (boom)"),
    ]
    assert hold.take() == []


def test_a_request_sent_during_start_up_runs_once_the_worker_is_ready(model_dir, tmp_path):
    folder = model_dir("llama")
    address = f"ipc://{tmp_path}/client.sock"
    config = tmp_path / "service.toml"
    config.write_text(f'[model]\npath = "{folder}"\n[server]\naddress = "{address}"\n'
                      "[scheduler]\nmax_context = 256\n[cache]\nkv_slots = 2048\n")
    proc, _, lines = start_runtime(config)
    svc = Service(proc=proc, address=address, lines=lines)
    try:
        worker = _worker_of(proc)
        os.kill(worker, signal.SIGSTOP)
        results: list = []
        try:
            with SyncClient(address) as client:
                status = client.status(timeout=TIMEOUT_S)  # answered while the worker is frozen
                assert status.worker_state == "starting" and status.waiting == 0
                prompt = [5, 9, 17, 3, 44]

                def send() -> None:
                    with SyncClient(address) as other:
                        results.append(other.generate(token_ids=prompt, max_tokens=6, ignore_eos=True))

                sender = threading.Thread(target=send)
                sender.start()
                while client.status(timeout=TIMEOUT_S).waiting < 1:  # held, not refused
                    assert sender.is_alive(), results
                assert not results and not any("serving" in line for line in list(lines))
        finally:
            os.kill(worker, signal.SIGCONT)
        sender.join(TIMEOUT_S)
        assert len(results) == 1, svc.log()
        assert results[0].token_ids == reference_greedy(folder, prompt, 6)
        with SyncClient(address) as client:
            assert client.status(timeout=TIMEOUT_S).worker_state == "up"
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                pass
        kill_group(proc)
