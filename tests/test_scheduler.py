"""Scheduler policy without MLX: exact slots, chunks, chaining, release and prefix reuse."""

from __future__ import annotations

import pytest

from runtime.scheduler.admission import Limits, RequestRejected
from runtime.scheduler.core import Scheduler
from runtime.scheduler.request import Request, SamplingParams

EOS = 0


def make(num_slots=64, max_rows=4, max_context=32, budget=16, chunk=8, cache=True) -> Scheduler:
    limits = Limits(num_slots, max_rows, max_context, 100, max_step_tokens=budget, prefill_chunk=chunk, cache_enabled=cache)
    return Scheduler(limits, frozenset({EOS}), debug_invariants=True)


def req(s: Scheduler, rid: str, prompt: list[int], max_tokens: int, **kw) -> Request:
    max_new = s.validate(prompt, max_tokens, 0.0)
    params = SamplingParams(max_tokens=max_tokens, stop_token_ids=frozenset(kw.get("stop", ())), ignore_eos=kw.get("ignore_eos", False))
    r = Request(rid=rid, prompt_ids=prompt, params=params, max_new=max_new)
    s.add(r)
    return r


def finish_step(s: Scheduler, planned, tokens=None):
    n = len(planned.decode_reqs)
    return s.on_step_done(planned.step.step_id, tokens if tokens is not None else [7] * n)


def drain(s: Scheduler, until=lambda: False) -> None:
    """Run like the server (two steps in flight) until idle or ``until()``."""
    inflight = []
    while not until():
        while len(inflight) < 2 and (p := s.next_step()) is not None:
            inflight.append(p)
        if not inflight:
            return
        finish_step(s, inflight.pop(0))
    for p in inflight:
        finish_step(s, p)


def test_validation_messages():
    s = make(num_slots=20, max_context=32)
    with pytest.raises(RequestRejected, match="empty"):
        s.validate([], 4, 0.0)
    with pytest.raises(RequestRejected, match="unknown token ids"):
        s.validate([1, 100], 4, 0.0)
    with pytest.raises(RequestRejected, match="context"):
        s.validate(list(range(1, 33)), 4, 0.0)
    with pytest.raises(RequestRejected, match="KV pool of 19"):
        s.validate(list(range(1, 16)), 10, 0.0)
    assert s.validate([1, 2, 3], 10, 0.0) == 10
    assert make(num_slots=64, max_context=32).validate([1, 2, 3], 100, 0.0) == 29  # clamped to the context


def test_chunked_prefill_then_chained_decode():
    s = make(budget=8, chunk=8)
    r = req(s, "a", list(range(1, 21)), 3)  # 20 tokens: 19 prefill positions, then decode
    p1 = s.next_step()
    assert [(c.start, len(c.token_ids)) for c in p1.step.prefills] == [(0, 8)]
    assert p1.step.prefills[0].slot_ids == list(range(1, 9))
    assert p1.step.decode is None
    p2 = s.next_step()
    assert [(c.start, len(c.token_ids)) for c in p2.step.prefills] == [(8, 8)]
    finish_step(s, p1)
    finish_step(s, p2)
    p3 = s.next_step()
    assert [(c.start, len(c.token_ids)) for c in p3.step.prefills] == [(16, 3)]
    d = p3.step.decode  # the request that finished prefill joins this step's decode
    assert d.rows == [0] and d.token_ids == [20] and d.positions == [19] and d.slot_ids == [20]
    p4 = s.next_step()
    assert p4.step.decode.token_ids == [-1] and p4.step.decode.positions == [20]
    finish_step(s, p3, [11])
    finish_step(s, p4, [12])
    p5 = s.next_step()
    out = finish_step(s, p5, [13])
    assert r.output_ids == [11, 12, 13] and r.finish_reason == "length" and out[-1].finished
    assert s.next_step() is None
    s.check_invariants()
    # Prompt + first two outputs stay cached (the last token's K/V was never written).
    assert s.tree.total_size == 22 and s.slots.free_count == 63 - 22


def test_long_prompt_does_not_stall_running_decode():
    s = make(num_slots=200, max_context=128, budget=10, chunk=8)
    short = req(s, "short", [1, 2], 20)
    finish_step(s, s.next_step())
    req(s, "long", list(range(1, 61)), 2)
    for _ in range(6):
        planned = s.next_step()
        assert short in planned.decode_reqs  # decode every step
        assert sum(len(c.token_ids) for c in planned.step.prefills) <= 10 - 1
        finish_step(s, planned)
    s.check_invariants()


def test_eos_finishes_and_drops_the_chained_token():
    s = make()
    r = req(s, "a", [5, 6, 7], 10)
    p1 = s.next_step()
    p2 = s.next_step()
    p3 = s.next_step()
    assert p3 is not None and r in p3.decode_reqs
    finish_step(s, p1, [9])
    finish_step(s, p2, [EOS])
    assert r.finish_reason == "stop" and r.output_ids == [9, EOS]
    assert finish_step(s, p3, [42]) == []  # dropped
    assert r.output_ids == [9, EOS]
    s.check_invariants()
    assert s.slots.free_count + s.tree.total_size == s.slots.capacity


def test_stop_token_ids_and_ignore_eos():
    s = make()
    a = req(s, "a", [5], 10, stop=[33])
    b = req(s, "b", [6], 10, ignore_eos=True)
    p = s.next_step()
    finish_step(s, p, [12, EOS])
    assert a.finish_reason is None and b.finish_reason is None
    p = s.next_step()
    finish_step(s, p, [33, EOS])
    assert a.finish_reason == "stop" and b.finish_reason is None


def test_prefix_hit_reuses_slots_and_full_hit_decodes_directly():
    s = make()
    a = req(s, "a", [1, 2, 3, 4, 5], 1)
    pa = s.next_step()
    finish_step(s, pa)
    assert a.finished
    b = req(s, "b", [1, 2, 3, 9, 9], 1)
    pb = s.next_step()
    assert b.prefix_len == 3 and pb.step.prefills[0].start == 3
    assert pb.step.prefills[0].prefix_slots == [1, 2, 3]
    finish_step(s, pb)
    c = req(s, "c", [1, 2, 3, 4, 5], 1)
    pc = s.next_step()
    assert c.prefix_len == 4 and pc.step.decode.token_ids == [5]
    # No forward for the prefix: only the table row is filled in.
    assert [(x.token_ids, x.prefix_slots) for x in pc.step.prefills] == [([], [1, 2, 3, 4])]
    finish_step(s, pc)
    s.check_invariants()


def test_cache_off_frees_everything():
    s = make(cache=False)
    req(s, "a", [1, 2, 3, 4, 5], 3)
    while (p := s.next_step()) is not None:
        finish_step(s, p)
    assert s.slots.free_count == s.slots.capacity and s.tree is None


def test_pool_pressure_waits_then_evicts():
    s = make(num_slots=24, max_rows=4, max_context=20, budget=64, chunk=64)
    a = req(s, "a", list(range(1, 11)), 8)  # needs 9 + 8 = 17 of 23 slots
    b = req(s, "b", list(range(20, 30)), 8)
    p = s.next_step()
    assert a in s.running and b in s.waiting  # b waits: not enough room for both
    finish_step(s, p)
    drain(s, until=lambda: b in s.running)
    assert a.finished and a.output_ids  # b was admitted only after a finished
    drain(s)
    assert b.finished and len(b.output_ids) == 8
    s.check_invariants()
    assert s.slots.free_count + s.tree.total_size == s.slots.capacity


def test_abort_waiting_and_running():
    s = make(max_rows=1)
    a = req(s, "a", [1, 2, 3], 10)
    b = req(s, "b", [4, 5, 6], 10)
    p = s.next_step()
    assert s.abort("b") is b and b.finish_reason == "abort"
    assert s.abort("a") is a and a.finish_reason == "abort"
    assert s.abort("zzz") is None
    finish_step(s, p)
    s.check_invariants()
    assert a.output_ids == [] and s.rows.free_count == 1


def test_worker_death_resets_everything():
    s = make()
    req(s, "a", [1, 2, 3], 10)
    s.next_step()
    failed = s.fail_all("worker died")
    assert [r.rid for r in failed] == ["a"] and failed[0].error == "worker died"
    assert s.inflight == {} and s.slots.free_count == s.slots.capacity
    s.check_invariants()


def _finished_with_a_step_in_flight(s: Scheduler):
    """A request that hits EOS at its second step while its third (chained) is in flight."""
    r = req(s, "a", [5, 6, 7], 10)
    p1, p2, p3 = s.next_step(), s.next_step(), s.next_step()
    finish_step(s, p1, [9])
    finish_step(s, p2, [EOS])
    return r, p3


def test_completion_is_reported_only_after_release_to_the_cache():
    """SPEC 5.2: snapshot, then release to the cache, then completion."""
    s = make()
    r, p3 = _finished_with_a_step_in_flight(s)
    assert r.finished and r in s.draining
    assert s.pop_completed() == []  # no reply yet: its K/V is not in the cache yet
    finish_step(s, p3, [42])
    assert s.pop_completed() == [r]
    # The cache now holds the prompt and every token fed to a finished step.
    assert len(s.tree.match_prefix([5, 6, 7, 9, EOS]).slots) == 5
    s.check_invariants()


def test_worker_death_while_draining_keeps_the_finish_reason():
    s = make()
    r, _ = _finished_with_a_step_in_flight(s)
    s.fail_all("worker died")
    assert s.pop_completed() == [r] and r.finish_reason == "stop"
    s.check_invariants()


def test_chunks_are_not_cut_just_to_fill_the_budget():
    s = make(num_slots=200, max_rows=4, max_context=64, budget=20, chunk=8)
    a, b, c = (req(s, rid, [k + 1] + list(range(1, 9)), 2) for k, rid in enumerate("abc"))  # 8 prefill positions each
    p1 = s.next_step()
    assert [(ch.row, ch.start, len(ch.token_ids)) for ch in p1.step.prefills] == [(0, 0, 8), (1, 0, 8)]
    assert c.prefilled == 0, "c's chunk must not be cut to the 4 tokens left"
    p2 = s.next_step()
    assert [(len(ch.token_ids)) for ch in p2.step.prefills] == [8]
    # Alone in a step, a chunk larger than the budget is still cut, so prefill always progresses.
    s2 = make(num_slots=200, max_rows=4, max_context=64, budget=5, chunk=8)
    req(s2, "x", list(range(1, 12)), 2)
    assert [len(ch.token_ids) for ch in s2.next_step().step.prefills] == [5]
