"""Auxiliary-state lifecycle (SPEC section 4): scheduler side without MLX, worker pool with MLX."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH
from runtime.scheduler.admission import Limits
from runtime.scheduler.core import Scheduler
from runtime.scheduler.request import Request, SamplingParams
from runtime.worker.pools.aux_pool import AuxPool


def make(aux_slots=16, track_chunk=64, chunk=256, budget=512, num_slots=1024, max_rows=4) -> Scheduler:
    limits = Limits(num_slots, max_rows, 512, 1000, max_step_tokens=budget, prefill_chunk=chunk,
                    aux_slots=aux_slots, track_chunk=track_chunk)
    return Scheduler(limits, frozenset({0}), debug_invariants=True)


def add(s: Scheduler, rid: str, prompt: list[int], max_tokens: int) -> Request:
    r = Request(rid=rid, prompt_ids=prompt, params=SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                max_new=s.validate(prompt, max_tokens, 0.0))
    s.add(r)
    return r


def drain(s: Scheduler, token: int = 7) -> list:
    steps, inflight = [], []
    while True:
        while len(inflight) < 2 and (p := s.next_step()) is not None:
            inflight.append(p)
            steps.append(p)
        if not inflight:
            return steps
        p = inflight.pop(0)
        s.on_step_done(p.step.step_id, [token] * len(p.decode_reqs))


def test_seventy_new_tokens_run_as_64_plus_6_and_keep_the_state_after_64():
    s = make()
    prompt = list(range(1, 72))  # 71 tokens: 70 prefill positions, the last one decodes
    r = add(s, "a", prompt, 2)
    p = s.next_step()
    chunks = p.step.prefills
    assert [len(c.token_ids) for c in chunks] == [64, 6]
    assert chunks[0].aux_source == AUX_FRESH and chunks[1].aux_source == AUX_CONTINUE
    assert chunks[0].aux_slot == chunks[1].aux_slot == r.aux_slot
    assert chunks[0].aux_snapshot > 0 and chunks[1].aux_snapshot > 0  # after 64 and at the prompt end
    assert p.step.decode.aux_slots == [r.aux_slot]
    # Both snapshots are tree values now, at lengths 64 and 70.
    m64 = s.tree.match_prefix(prompt[:64])
    assert m64.aux_slot == chunks[0].aux_snapshot and m64.aux_len == 64
    m70 = s.tree.match_prefix(prompt[:70])
    assert m70.aux_slot == chunks[1].aux_snapshot and m70.aux_len == 70
    drain(s)
    s.check_invariants()


def test_prefix_hit_restores_the_state_at_a_chunk_boundary():
    s = make()
    shared = list(range(1, 81))
    add(s, "a", shared + [500], 1)
    drain(s)
    b = add(s, "b", shared[:64] + [900 + i for i in range(30)], 1)
    p = s.next_step()
    assert b.prefix_len == 64  # the state saved after 64 tokens
    first = p.step.prefills[0]
    assert first.start == 64 and first.aux_source == s.tree.match_prefix(shared[:64]).aux_slot
    drain(s)
    s.check_invariants()


def test_a_shared_prefix_gets_a_state_once_a_second_request_leaves_it():
    """A system prompt of 200 tokens, then each request's own 100: the first request's chunk
    multiple (256) falls in its own text, so the second matches 200 tokens it cannot restore;
    it keeps the state at 200, where every later request starts."""
    s = make()
    system = list(range(1, 201))
    a = add(s, "a", system + [300 + i for i in range(100)], 1)
    s.next_step()
    assert a.aux_points == [256, 299]
    drain(s)
    b = add(s, "b", system + [500 + i for i in range(100)], 1)
    p = s.next_step()
    assert b.prefix_len == 0 and b.aux_points == [200, 256, 299]  # 200 matched, nothing to restore
    assert [c.start + len(c.token_ids) for c in p.step.prefills] == [200, 256, 299]
    drain(s)
    c = add(s, "c", system + [700 + i for i in range(100)], 1)
    p = s.next_step()
    assert c.prefix_len == 200 and p.step.prefills[0].start == 200
    assert p.step.prefills[0].aux_source == s.tree.match_prefix(system).aux_slot
    assert c.aux_points == [264, 299]  # restored where it leaves the path: no extra point
    drain(s)
    # A request restoring a state less than a chunk short of where it leaves the path keeps
    # no extra point either (209 matched, 200 restored).
    d = add(s, "d", system + [700 + i for i in range(9)] + [900 + i for i in range(60)], 1)
    s.next_step()
    assert d.prefix_len == 200 and d.aux_points == [264, 268]
    drain(s)
    s.check_invariants()


def test_a_chat_keeps_the_state_where_its_system_part_ends_from_the_first_request():
    """``shared_prefix`` (the chat's system part, 200 tokens): the first request keeps the state
    there, so the second restores it already."""
    s = make()
    system = list(range(1, 201))
    a = add(s, "a", system + [300 + i for i in range(100)], 1)
    a.shared_prefix = 200
    s.next_step()
    assert a.aux_points == [200, 256, 299]
    drain(s)
    b = add(s, "b", system + [500 + i for i in range(100)], 1)
    b.shared_prefix = 200
    s.next_step()
    assert b.prefix_len == 200 and b.aux_points == [264, 299]
    drain(s)
    c = add(s, "c", list(range(1, 40)), 1)
    c.shared_prefix = 30  # less than a chunk past where it starts: no point of its own
    s.next_step()
    assert c.aux_points == [38]
    drain(s)
    s.check_invariants()


def test_a_long_shared_path_holding_most_of_the_pool_does_not_stall_admission():
    """Prompts that extend one another keep their states along one path of the tree; the next
    one locks that whole path when it matches. With 7 usable slots, all but one held on that
    path, it used to wait forever (nothing running, nothing to evict); now the path's older
    states are dropped, the one it restores kept."""
    s = make(aux_slots=8, track_chunk=16, chunk=48, budget=96, max_rows=4)
    prompts = [list(range(1, 41)) + [300], list(range(1, 91)) + [301], list(range(1, 151)) + [302]]
    for i, p in enumerate(prompts):
        add(s, f"a{i}", p, 1)
        drain(s)
    last = add(s, "last", list(range(1, 151)) + [303, 304], 1)
    drain(s)
    assert last.finished and last.prefix_len == 150
    s.check_invariants()


def test_exact_full_prompt_hit_restores_and_reruns_the_last_token():
    s = make()
    prompt = list(range(1, 41))
    add(s, "a", prompt, 3)
    drain(s)
    b = add(s, "b", prompt, 3)
    p = s.next_step()
    assert b.prefix_len == 39
    (only,) = p.step.prefills
    assert only.token_ids == [] and only.aux_source >= 0 and p.step.decode.token_ids == [40]
    drain(s)
    s.check_invariants()


def test_no_aux_slot_leaks_under_pressure():
    s = make(aux_slots=9, num_slots=400, max_rows=3)
    for i in range(12):
        add(s, f"r{i}", [1 + i % 3] * 5 + list(range(10, 10 + 60 + i)), 5)
    drain(s)
    s.check_invariants()
    assert s.aux.slots.free_count + len(s.tree.owned_aux_slots()) == s.aux.slots.capacity
    assert all(r.finished for r in [])  # nothing running
    assert s.running == [] and not s.waiting


def test_abort_mid_prefill_frees_aux_slots():
    s = make(chunk=16, budget=32)
    r = add(s, "a", list(range(1, 200)), 4)
    p = s.next_step()
    assert r.prefilled == 32
    s.abort("a")
    assert r in s.draining  # its launched chunk still writes the live slot
    s.on_step_done(p.step.step_id, [])
    assert r.aux_owned == [] and r.aux_slot == -1 and s.draining == []
    s.check_invariants()
    # What it prefilled is cached, with the state that covers it.
    assert s.tree.match_prefix(list(range(1, 200))).aux_len == 32


def _pool(row_writes: bool = False) -> AuxPool:
    return AuxPool.allocate([[((3, 4), mx.float32), ((2,), mx.float32)]], num_slots=6, row_writes=row_writes)


@pytest.mark.parametrize("row_writes", [False, True], ids=["scatter", "row-writes"])
def test_aux_pool_store_restore_fork_and_snapshots_are_copies(row_writes):
    pool = _pool(row_writes)
    live = mx.array([2])
    state = [mx.ones((1, 3, 4)), mx.full((1, 2), 5.0)]
    pool.write(0, live, state)
    pool.copy(2, 4)  # snapshot live -> 4
    pool.write(0, live, [mx.zeros((1, 3, 4)), mx.zeros((1, 2))])  # the live state moves on
    snap = pool.read(0, mx.array([4]))
    assert mx.array_equal(snap[0], state[0]) and mx.array_equal(snap[1], state[1])
    pool.copy(4, 5)  # fork the snapshot into a new slot
    assert mx.array_equal(pool.read(0, mx.array([5]))[1], state[1])
    pool.copy(4, 2)  # restore into the live slot
    assert mx.array_equal(pool.read(0, live)[0], state[0])
    pool.zero(2)
    assert float(pool.read(0, live)[0].sum()) == 0.0


@pytest.mark.parametrize("row_writes", [False, True], ids=["scatter", "row-writes"])
def test_batched_read_and_write_split_state_per_request(row_writes):
    pool = _pool(row_writes)
    pool.write(0, mx.array([1, 3]), [mx.stack([mx.full((3, 4), 1.0), mx.full((3, 4), 3.0)]), mx.array([[1.0, 1], [3, 3]])])
    merged = pool.read(0, mx.array([3, 1]))
    assert merged[0].shape == (2, 3, 4) and merged[1].tolist() == [[3, 3], [1, 1]]


def test_row_writes_match_the_scatter_inside_a_compiled_step():
    """A CPU's pool writes a batch slot by slot (``row_writes``, a flush's write-back), also
    where the slots are a traced input of a compiled function: the same slots end up with the
    same states, the others untouched, whatever the order of the slots."""
    rng = np.random.default_rng(0)
    values = [mx.array(rng.normal(size=(3, 3, 4)).astype(np.float32)), mx.array(rng.normal(size=(3, 2)).astype(np.float32))]
    slots = mx.array([4, 1, 3], dtype=mx.int32)
    results = []
    for row_writes in (False, True):
        pool = _pool()
        pool.write(0, mx.arange(6), [mx.full((6, 3, 4), 7.0), mx.full((6, 2), 7.0)])

        def step(states, slots, values):
            traced = AuxPool(states, row_writes)
            traced.write(0, slots, values)
            return traced.states

        pool.states = mx.compile(step)(pool.states, slots, values)
        results.append([np.array(a) for a in pool.states[0]])
    for scattered, written in zip(*results):
        assert np.array_equal(scattered, written)
    assert np.array_equal(results[1][1][[4, 1, 3]], np.array(values[1])) and (results[1][1][[0, 2, 5]] == 7.0).all()


def test_the_loader_writes_aux_states_slot_by_slot_on_a_cpu(tmp_path):
    from model_factory import make_model

    from runtime.config import parse_config
    from runtime.worker.loader import load

    folder = make_model("qwen3_next", tmp_path / "m")
    config = parse_config({"model": {"path": str(folder)}, "cache": {"kv_slots": 256, "aux_slots": 8},
                           "scheduler": {"max_running": 2, "max_context": 128}})
    _, aux = load(config).make_pools()
    assert aux is not None and aux.row_writes == (mx.default_device().type == mx.DeviceType.cpu)


def _filled(row_writes: bool = False) -> AuxPool:
    """A pool whose slot s holds s in every element."""
    pool = _pool(row_writes)
    slots = mx.arange(6)
    pool.write(0, slots, [mx.broadcast_to(slots.astype(mx.float32)[:, None, None], (6, 3, 4)),
                          mx.broadcast_to(slots.astype(mx.float32)[:, None], (6, 2))])
    return pool


@pytest.mark.parametrize("row_writes", [False, True], ids=["scatter", "row-writes"])
def test_a_steady_decode_batch_keeps_its_states_out_of_the_pool(row_writes):
    """A decode batch's new states stay batch-ordered (``keep``) while the same slots decode in
    the same order: the next ``batch_states`` returns them without touching the pool, and the pool
    still holds the old values until another batch comes."""
    pool = _filled(row_writes)
    first, wrote = pool.batch_states([3, 1])
    assert first[0][1].tolist() == [[3, 3], [1, 1]] and not wrote
    new = [[first[0][0] + 10, first[0][1] + 10]]
    pool.keep([3, 1], new)
    assert pool.batch_states([3, 1]) == (new, False)  # resident: no gather
    assert pool._read(0, mx.array([3, 1]))[1].tolist() == [[3, 3], [1, 1]]  # the pool is stale meanwhile
    assert len(pool.arrays()) == 4  # the write marker covers the resident states too
    # A batch that only lost a row (and gained a padding row, slot 0) keeps the rest resident;
    # the row that left is written before anything reads its slot.
    states, wrote = pool.batch_states([1, 0])
    assert states[0][1][:1].tolist() == [[11, 11]] and not wrote and pool.resident_slots == (1, 0)
    assert pool._read(0, mx.array([3]))[1].tolist() == [[3, 3]] and len(pool.arrays()) == 6
    assert pool.read(0, mx.array([3]))[1].tolist() == [[13, 13]]  # an access flushes first
    assert pool.resident_slots is None and not pool.left
    # Another batch (a new slot): the resident states go into the pool first, a write in place.
    pool.keep([1], [[mx.zeros((1, 3, 4)), mx.full((1, 2), 21.0)]])
    states, wrote = pool.batch_states([1, 2])
    assert wrote and states[0][1].tolist() == [[21, 21], [2, 2]] and pool.resident_slots is None


@pytest.mark.parametrize("row_writes", [False, True], ids=["scatter", "row-writes"])
def test_an_access_to_a_resident_slot_writes_the_batch_back_first(row_writes):
    """Prefill, snapshots and restores see a resident slot's newest state; an access to other
    slots leaves the batch resident."""
    pool = _filled(row_writes)
    pool.keep([2, 4], [[mx.full((2, 3, 4), 20.0), mx.array([[20.0, 20], [40, 40]])]])
    pool.copy(1, 5)  # touches no resident slot
    pool.zero(3)
    assert pool.read(0, mx.array([5]))[1].tolist() == [[1, 1]]
    assert pool.resident_slots == (2, 4)
    pool.copy(4, 5)  # a snapshot of a resident row
    assert pool.resident_slots is None
    assert pool.read(0, mx.array([5]))[1].tolist() == [[40, 40]]
    assert pool.read(0, mx.array([2]))[0].sum().item() == 20.0 * 12
    pool.keep([2], [[mx.zeros((1, 3, 4)), mx.full((1, 2), 9.0)]])
    pool.write(0, mx.array([2]), [mx.ones((1, 3, 4)), mx.ones((1, 2))])  # a prefill overwrites the slot
    assert pool.read(0, mx.array([2]))[1].tolist() == [[1, 1]]  # not the older resident value
    pool.keep([2], [[mx.zeros((1, 3, 4)), mx.full((1, 2), 8.0)]])
    assert pool.caches(mx.array([2]))[0].cache[1].tolist() == [[8, 8]]  # a prefix restore reads it
    pool.keep([2], [[mx.zeros((1, 3, 4)), mx.full((1, 2), 7.0)]])
    restored = AuxPool.wrap([[mx.ones((1, 3, 4)), mx.full((1, 2), 6.0)]])
    pool.store(restored, mx.array([2]))  # a prefill's states, written over the resident row's
    assert pool.batch_states([2])[0][0][1].tolist() == [[6, 6]]
    pool.keep([4], [[mx.zeros((1, 3, 4)), mx.full((1, 2), 9.0)]])
    pool.drop()  # a failed step: what evaluates reaches the pool (a finished row's state was cached)
    assert pool.resident_slots is None and pool.batch_states([4])[0][0][1].tolist() == [[9, 9]]
