"""Client connections, frame layouts, the waiting queue and request checks, without sockets or MLX."""

from __future__ import annotations

import math

import pytest

from runtime.scheduler.admission import Limits, RequestRejected, checked_temperature
from runtime.scheduler.core import Scheduler
from runtime.scheduler.frames import BadFrames, split_frames
from runtime.scheduler.peers import OUTBOX_MAX_BYTES, PeerBusy, PeerGone, PeerTable
from runtime.scheduler.request import Request, SamplingParams
from runtime.scheduler.waiting import WaitingQueue


class FakeRouter:
    """A ROUTER with per-peer capacity: ``room[id]`` messages fit, a missing id is gone."""

    def __init__(self) -> None:
        self.room: dict[bytes, int] = {}
        self.sent: list[list[bytes]] = []

    def send(self, frames: list[bytes]) -> None:
        ident = frames[0]
        if ident not in self.room:
            raise PeerGone
        if self.room[ident] == 0:
            raise PeerBusy
        self.room[ident] -= 1
        self.sent.append(frames)


def test_replies_wait_in_order_while_a_client_is_busy_and_none_is_lost():
    router = FakeRouter()
    table = PeerTable(router.send, slow_timeout_s=10)
    peer = table.get(b"a")
    peer.requests["x"] = object()
    router.room[b"a"] = 2
    for i in range(5):
        table.send(peer, [b"m%d" % i], now=0.0)
    assert [f[1] for f in router.sent] == [b"m0", b"m1"]
    assert list(peer.outbox) == [[b"m2"], [b"m3"], [b"m4"]] and peer in table.backlogged
    table.check_invariants()
    router.room[b"a"] = 1
    assert table.flush(now=1.0) == []
    table.send(peer, [b"m5"], now=1.0)  # queued behind the backlog, never ahead of it
    router.room[b"a"] = 100
    assert table.flush(now=2.0) == []
    assert [f[1] for f in router.sent] == [b"m%d" % i for i in range(6)]
    assert not peer.outbox and peer not in table.backlogged
    table.check_invariants()


def test_a_client_that_stops_reading_is_dropped_after_the_timeout():
    router = FakeRouter()
    table = PeerTable(router.send, slow_timeout_s=5)
    peer = table.get(b"a")
    peer.requests["x"] = object()
    router.room[b"a"] = 0
    table.send(peer, [b"m"], now=0.0)
    assert table.flush(now=4.0) == []  # still within the timeout
    assert table.flush(now=6.0) == [peer]
    assert peer.gone and not peer.outbox and b"a" not in table.peers
    table.send(peer, [b"late"], now=7.0)  # replies to a gone peer are dropped
    assert router.sent == []
    table.check_invariants()


def test_a_client_whose_backlog_is_too_large_is_dropped():
    router = FakeRouter()
    table = PeerTable(router.send, slow_timeout_s=1000)
    peer = table.get(b"a")
    peer.requests["x"] = object()
    router.room[b"a"] = 0
    big = b"x" * (OUTBOX_MAX_BYTES // 4)
    for _ in range(5):
        table.send(peer, [big], now=0.0)
    assert table.flush(now=0.1) == [peer] and peer.gone


def test_progress_resets_the_slow_timer():
    router = FakeRouter()
    table = PeerTable(router.send, slow_timeout_s=5)
    peer = table.get(b"a")
    peer.requests["x"] = object()
    router.room[b"a"] = 0
    for i in range(3):
        table.send(peer, [b"m%d" % i], now=0.0)
    router.room[b"a"] = 1
    assert table.flush(now=4.0) == []  # one message went out at t=4
    assert table.flush(now=8.0) == []  # 4 s since the last progress
    assert table.flush(now=9.5) == [peer]


def test_probe_finds_departed_clients_and_send_reports_them():
    router = FakeRouter()
    table = PeerTable(router.send, slow_timeout_s=5)
    alive, left, idle = table.get(b"a"), table.get(b"b"), table.get(b"c")
    alive.requests["x"] = left.requests["y"] = object()
    router.room.update({b"a": 10, b"c": 10})
    assert table.probe(b"ping") == [left] and left.gone
    assert router.sent == [[b"a", b"ping"]]  # peers without requests are not pinged
    gone = table.get(b"d")
    with pytest.raises(PeerGone):
        table.send(gone, [b"m"], now=0.0)
    assert gone.gone
    table.forget_if_idle(idle)
    assert set(table.peers) == {b"a"}


def test_frame_layouts():
    assert split_frames([b"id", b"p"]).envelope == ()
    req = split_frames([b"id", b"", b"p"])
    assert req.envelope == (b"",) and req.payload == b"p"
    proxied = split_frames([b"id", b"hop", b"", b"p"])
    assert proxied.envelope == (b"hop", b"") and proxied.payload == b"p"
    for frames in ([b"id", b"p", b"x"], [b"id", b"a", b"b", b"c"], [b"id"]):
        with pytest.raises(BadFrames):
            split_frames(frames)


def _req(rid: str) -> Request:
    return Request(rid=rid, prompt_ids=[1, 2, 3], params=SamplingParams(max_tokens=4), max_new=4)


def test_waiting_queue_keeps_order_and_removes_anywhere():
    q = WaitingQueue()
    reqs = [_req(f"r{i}") for i in range(6)]
    for r in reqs:
        q.append(r)
    q.remove(reqs[3])
    q.remove(reqs[0])
    assert q.peek() is reqs[1] and len(q) == 4 and reqs[3] not in q
    assert [q.popleft() for _ in range(4)] == [reqs[1], reqs[2], reqs[4], reqs[5]]
    assert not q


def test_scheduler_aborts_any_of_many_waiting_requests_by_id():
    s = Scheduler(Limits(num_slots=64, max_rows=2, max_context=32, vocab_size=100), frozenset())
    reqs = [_req(f"r{i}") for i in range(20000)]
    for r in reqs:
        s.add(r)
    assert s.abort("r12345") is reqs[12345] and reqs[12345].finish_reason == "abort"
    assert s.abort("r12345") is None  # finished: no longer live
    assert len(s.waiting) == 19999 and reqs[12345] not in s.waiting
    planned = s.next_step()
    assert planned is not None and {r.rid for r in s.running} == {"r0", "r1"}
    assert s.abort("r0") is reqs[0]
    assert [r.rid for r in s.pop_completed()] == ["r12345"]  # r0 drains: its step is in flight


@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf, -0.5, 1e5])
def test_bad_temperatures_are_refused(bad):
    with pytest.raises(RequestRejected, match="temperature"):
        checked_temperature(bad)


def test_tiny_temperatures_are_greedy():
    assert checked_temperature(1e-40) == 0.0
    assert checked_temperature(0.0) == 0.0
    assert checked_temperature(0.7) == 0.7
