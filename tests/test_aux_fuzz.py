"""Random hybrid traffic through the scheduler (no MLX): prompts sharing prefixes of random
lengths, arriving at random steps, some aborted mid-way. Every aux slot stays free, owned by one
running request, or held by the tree, and the pool is whole again at the end (SPEC 4.5)."""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from runtime.scheduler.admission import Limits
from runtime.scheduler.core import Scheduler
from runtime.scheduler.request import Request, SamplingParams

SYSTEMS = [list(range(1, 1 + n)) for n in (40, 90, 150)]

request_st = st.tuples(
    st.integers(0, len(SYSTEMS)),   # which shared prefix (the last index: none)
    st.integers(1, 120),            # own tokens after it
    st.integers(1, 6),              # new tokens
    st.integers(0, 12),             # arrival step
    st.one_of(st.none(), st.integers(0, 15)),  # abort at this step, or never
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(request_st, min_size=1, max_size=14), st.sampled_from([16, 32, 64]), st.integers(8, 24))
def test_hybrid_traffic_keeps_every_aux_slot_accounted_for(requests, track, aux_slots):
    limits = Limits(4096, 4, 512, 1000, max_step_tokens=96, prefill_chunk=48, aux_slots=aux_slots,
                    track_chunk=track)
    s = Scheduler(limits, frozenset({0}), debug_invariants=True)
    arrivals: dict[int, list[Request]] = {}
    aborts: dict[int, list[str]] = {}
    for i, (system, own, new, at, abort_at) in enumerate(requests):
        prefix = SYSTEMS[system] if system < len(SYSTEMS) else []
        prompt = prefix + [300 + (i * 37 + j) % 600 for j in range(own)]
        r = Request(rid=f"r{i}", prompt_ids=prompt, params=SamplingParams(max_tokens=new, ignore_eos=True),
                    max_new=new)
        arrivals.setdefault(at, []).append(r)
        if abort_at is not None:
            aborts.setdefault(abort_at, []).append(r.rid)
    inflight, step = [], 0
    while step < 400:
        for r in arrivals.pop(step, []):
            r.max_new = s.validate(r.prompt_ids, r.max_new, 0.0)
            s.add(r)
        for rid in aborts.pop(step, []):
            s.abort(rid)
        while len(inflight) < 2 and (p := s.next_step()) is not None:
            inflight.append(p)
        if inflight:
            p = inflight.pop(0)
            s.on_step_done(p.step.step_id, [7] * len(p.decode_reqs))
        elif not arrivals and not aborts:
            break
        s.check_invariants()
        step += 1
    assert not s.running and not s.waiting and not inflight
    aux = s.aux
    assert aux.reserved == 0
    assert aux.slots.free_count + len(s.tree.owned_aux_slots()) == aux.slots.capacity
