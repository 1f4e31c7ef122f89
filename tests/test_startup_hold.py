"""Client messages while the worker starts: status answers "starting", requests wait and then run.

Unit tests drive ``StartupHold`` with a recording stand-in for the client socket's sender; the
service test freezes a real `runtime up`'s worker (SIGSTOP) as soon as it is launched.
"""

from __future__ import annotations

import os
import signal
import threading

import msgspec
from conftest import Service, start_runtime, stop_runtime, worker_pid
from hypothesis import given, settings
from hypothesis import strategies as st
from model_factory import reference_greedy

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


def test_requests_are_held_in_order_and_everything_else_is_answered_at_once():
    hold, out = _hold(max_waiting=4)
    g1 = cp.Generate(rid="g1", token_ids=[1, 2], max_tokens=3)
    g2 = cp.Generate(rid="g2", token_ids=[3], max_tokens=1)
    first, second = _frames(b"a", g1), _frames(b"b", g2)
    dropped = _frames(b"a", cp.Generate(rid="g3", token_ids=[4], max_tokens=1))
    for frames in (first, second, dropped):
        hold.on_frames(frames)
    assert out.sent == []  # requests wait
    hold.on_frames(_frames(b"c", cp.StatusQuery(rid="s1")))
    identity, status = out.sent.pop()
    assert identity == b"c" and isinstance(status, cp.StatusReply)
    assert (status.rid, status.worker_state, status.waiting, status.worker_pid) == ("s1", "starting", 3, 4321)
    assert status.max_context == 512 and status.model == "/m" and status.model_type == ""  # no such folder
    hold.on_frames(_frames(b"a", cp.Abort(rid="g3")))  # a held request aborted: it ends now
    hold.on_frames(_frames(b"b", cp.Abort(rid="g1")))  # another connection's rid: not found
    hold.on_frames([b"d", b"\xc1 not msgpack"])
    hold.on_frames([b"e"])  # no payload frame at all
    replies = [(i, type(m).__name__, getattr(m, "rid", None)) for i, m in out.sent]
    assert replies == [(b"a", "AbortReply", "g3"), (b"a", "Done", "g3"), (b"b", "AbortReply", "g1"),
                       (b"d", "ProtocolError", ""), (b"e", "ProtocolError", "")]
    assert out.sent[0][1].found and out.sent[1][1].finish_reason == "abort" and not out.sent[2][1].found
    assert hold.take() == [(b"a", (), g1), (b"b", (), g2)]  # replayed in arrival order, already decoded
    assert hold.take() == []


def test_past_max_waiting_a_request_is_refused_at_once():
    hold, out = _hold(max_waiting=2)
    for i in range(3):
        hold.on_frames(_frames(b"a", cp.Generate(rid=f"g{i}", token_ids=[1], max_tokens=1)))
    assert len(hold.take()) == 2
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
        worker = worker_pid(proc)
        os.kill(worker, signal.SIGSTOP)
        results: list = []
        try:
            with SyncClient(address) as client:
                status = client.status(timeout=TIMEOUT_S)  # answered while the worker is frozen
                assert status.worker_state == "starting" and status.waiting == 0 and status.model_type == "llama"
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
        stop_runtime(proc, timeout=15)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.one_of(
    st.lists(st.binary(max_size=40), max_size=4),
    st.builds(lambda ident, rid: _frames(ident, cp.Generate(rid=rid, token_ids=[1], max_tokens=1)),
              st.binary(min_size=1, max_size=3), st.text(max_size=3)),
    st.builds(lambda ident, rid: _frames(ident, cp.Abort(rid=rid)), st.binary(min_size=1, max_size=3), st.text(max_size=3)),
), max_size=30))
def test_no_client_message_breaks_or_overfills_the_hold(messages):
    hold, out = _hold(max_waiting=5)
    for frames in messages:
        if frames:
            hold.on_frames(frames)
        assert len(hold._held) <= 5
    held = hold.take()
    generates = sum(1 for f in messages if len(f) == 2 and f[1][:1] != b"" and _is_generate(f[1]))
    # every request is held or answered (refused, aborted): none is lost
    answered = sum(1 for _, m in out.sent if isinstance(m, cp.Done))
    assert len(held) + answered == generates


def _is_generate(payload: bytes) -> bool:
    try:
        return isinstance(cp.client_msg_decoder.decode(payload), cp.Generate)
    except Exception:
        return False
