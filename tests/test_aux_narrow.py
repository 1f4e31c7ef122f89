"""A hybrid's resident recurrent states (``AuxPool.batch_states``/``keep``) against a plain model of
every slot's newest state, under random decode batches that continue, lose rows (``_narrowed``)
or change, mixed with the accesses prefill and the prefix cache make, and failed steps' resets."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest

from runtime.worker.pools.aux_pool import AuxPool


@pytest.mark.parametrize("row_writes", [False, True], ids=["scatter", "row-writes"])
@pytest.mark.parametrize("seed", range(3))
def test_resident_states_under_random_batches_and_accesses(seed, row_writes):
    rng = random.Random(seed)
    pool = AuxPool.allocate([[((2,), mx.float32)]], 24, row_writes=row_writes)
    newest = {slot: 0.0 for slot in range(24)}  # what a reader of each slot must see
    batch: list[int] = []
    narrowed = wrote_in_place = 0
    for step in range(150):
        move = rng.random()
        if not batch or move < 0.1:  # another batch: new slots
            batch = rng.sample(range(1, 24), rng.randint(1, 6))
        elif move < 0.3 and len(batch) > 1:  # rows leave (and the rest may reorder)
            batch = rng.sample(batch, rng.randint(1, len(batch) - 1))
        pad = (1 << (len(batch) - 1).bit_length()) - len(batch)
        slots = batch + [0] * pad  # padding rows decode at slot 0
        before = pool.resident_slots
        states, wrote = pool.batch_states(slots)
        narrowed += before is not None and before != tuple(slots) and not wrote
        wrote_in_place += wrote
        got = states[0][0][:, 0].tolist()
        assert got[: len(batch)] == [newest[s] for s in batch], step
        # a decode step: every row's state moves on (padding rows' too, into slot 0)
        new = [[states[0][0] + 1.0]]
        pool.keep(slots, new)
        for s in batch:
            newest[s] += 1.0
        access = rng.random()
        slot = rng.randrange(1, 24)
        if access < 0.15:  # a prefill restores a state (a prefix hit)
            assert pool.read(0, mx.array([slot]))[0][0, 0].item() == newest[slot]
        elif access < 0.25:  # a snapshot into another slot (never one a request decodes)
            dst = rng.choice([s for s in range(1, 24) if s not in batch])
            pool.copy(slot, dst)
            newest[dst] = newest[slot]
        elif access < 0.3:  # a fresh request's state
            if slot not in batch:
                pool.zero(slot)
                newest[slot] = 0.0
        elif access < 0.35:  # a failed step: what evaluates reaches the pool
            pool.drop()
            batch = []
    assert narrowed >= 5 and wrote_in_place >= 5
    pool.flush()
    for slot in range(1, 24):
        assert pool._read(0, mx.array([slot]))[0][0, 0].item() == newest[slot], slot
