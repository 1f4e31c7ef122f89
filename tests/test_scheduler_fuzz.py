"""Random plain (attention-only) traffic through the scheduler, no MLX: prompts sharing prefixes,
a KV pool too small for everyone at once (admission waits, the tree evicts), arrivals over time,
aborts, end-of-sequence tokens, failed steps and worker deaths.

Whatever the traffic: every slot stays free, owned by one request or held by the tree at every
step (``check_invariants``); every request is answered exactly once, with a finish reason; the
queue always drains (no request waits forever while nothing runs); and at the end every row and
reservation is back and the pool is whole (SPEC 2.1, 5.1, 8.1)."""

from __future__ import annotations

import random

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.scheduler.admission import Limits, RequestRejected
from runtime.scheduler.core import Scheduler
from runtime.scheduler.request import Request, SamplingParams

EOS = 0
SYSTEMS = [list(range(1, 1 + n)) for n in (30, 70, 130)]

request_st = st.tuples(
    st.integers(0, len(SYSTEMS)),   # which shared prefix (the last index: none)
    st.integers(1, 90),             # own tokens after it
    st.integers(1, 24),             # max new tokens
    st.booleans(),                  # stops at EOS (else ignore_eos)
    st.integers(0, 20),             # arrival step
    st.one_of(st.none(), st.integers(0, 30)),  # abort at this step, or never
)
event_st = st.tuples(st.integers(0, 60), st.sampled_from(["step_failed", "worker_died"]))


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.lists(request_st, min_size=1, max_size=16),
    st.lists(event_st, max_size=2),
    st.sampled_from([260, 400, 1024]),   # KV pool slots (slot 0 reserved)
    st.integers(1, 5),                   # rows
    st.sampled_from([True, False]),      # prefix cache on
    st.integers(0, 2**16),               # the fake worker's tokens
)
def test_plain_traffic_answers_everyone_and_keeps_every_slot_accounted_for(
        requests, events, num_slots, rows, cache_on, seed):
    limits = Limits(num_slots, rows, 256, 1000, max_step_tokens=64, prefill_chunk=32, cache_enabled=cache_on)
    s = Scheduler(limits, frozenset({EOS}), debug_invariants=True)
    rng = random.Random(seed)
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i, (system, own, new, stops, at, abort_at) in enumerate(requests):
        prefix = SYSTEMS[system] if system < len(SYSTEMS) else []
        prompt = prefix + [300 + (i * 37 + j) % 600 for j in range(own)]
        r = Request(rid=f"r{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=new, ignore_eos=not stops),
                    max_new=new)
        arrivals.setdefault(at, []).append(r)
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(r.rid)
    failures = dict(events)
    added: set[str] = set()
    answered: dict[str, Request] = {}
    inflight = []
    for step in range(2000):
        for r in arrivals.pop(step, []):
            try:
                r.max_new = s.validate(r.prompt_ids, r.max_new, 0.0)
            except RequestRejected:
                continue  # larger than the pool: refused at the door, never queued
            s.add(r)
            added.add(r.rid)
        for rid in aborts.pop(step, []):
            s.abort(rid)
        event = failures.pop(step, None)
        if event == "worker_died":
            s.fail_all("worker died")
            inflight = []
        while len(inflight) < s.pipeline_depth and (p := s.next_step()) is not None:
            inflight.append(p)
        if inflight:
            p = inflight.pop(0)
            if event == "step_failed":
                s.on_step_failed(p.step.step_id, "boom")
                live = {q.step.step_id for q in inflight}
                inflight = [q for q in inflight if q.step.step_id in live]
            else:
                # Mostly ordinary tokens, now and then an end of sequence.
                tokens = [EOS if rng.random() < 0.08 else rng.randrange(1, 1000) for _ in p.decode_reqs]
                s.on_step_done(p.step.step_id, tokens)
        for req in s.pop_completed():
            assert req.rid not in answered, f"{req.rid} answered twice"
            assert req.finish_reason is not None
            answered[req.rid] = req
        s.check_invariants()
        if not inflight and not arrivals and not aborts and not failures and not s.waiting:
            break
    else:
        raise AssertionError(f"the queue never drained: {len(s.waiting)} waiting, {len(s.running)} running")
    assert set(answered) == added, f"never answered: {sorted(added - set(answered))}"
    for req in answered.values():
        if req.finish_reason == "length":
            assert len(req.output_ids) == req.max_new
        if req.finish_reason == "stop":
            assert req.output_ids[-1] == EOS and not req.params.ignore_eos
    assert not s.running and not s.draining and not s.inflight
    assert s.reserved == 0
    assert s.rows.free_count == rows
    held = s.tree.total_size if s.tree is not None else 0
    assert s.slots.free_count + held == s.slots.capacity
