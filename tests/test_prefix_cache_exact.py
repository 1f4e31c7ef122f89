"""Radix prefix reuse through the real scheduler and worker engine, token-exact against mlx-lm."""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from model_factory import reference_greedy
from near_tie import assert_greedy_like_mlx


@pytest.fixture(params=["llama", "qwen3"])
def folder(request, model_dir):
    return model_dir(request.param)


def test_prefix_hit_matches_cold_run(folder):
    svc = InProcessService(folder)
    rng = random.Random(11)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    first = svc.request("first", shared + [7, 8, 9], 12)
    svc.run({0: [first]})
    second = svc.request("second", shared + [10, 11], 12)
    again = svc.request("again", shared + [7, 8, 9], 12)  # full prompt hit: only the last token runs
    svc.run({0: [second, again]})
    assert second.prefix_len == 40 and again.prefix_len == 42
    for r in (first, second, again):
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, 12)


def test_32_requests_shared_prefixes_with_eviction(folder):
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 250) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    outputs = {}
    for cache in (True, False):
        svc = InProcessService(folder, kv_slots=600, max_running=8, prefill_chunk=32, max_step_tokens=64, cache=cache)
        evicted = []
        if cache:
            evict = svc.sched.tree.evict
            svc.sched.tree.evict = lambda n: evicted.append(evict(n)) or evicted[-1]
        rng = random.Random(9)
        reqs, arrivals = [], {}
        for i in range(32):
            prompt = prefixes[i % 4] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 16))]
            r = svc.request(f"r{i}", prompt, rng.randint(4, 16))
            reqs.append(r)
            arrivals.setdefault(rng.randint(0, 40), []).append(r)
        svc.run(arrivals)
        s = svc.sched
        tree_size = s.tree.total_size if s.tree is not None else 0
        assert s.slots.free_count + tree_size == s.slots.capacity
        outputs[cache] = [r.output_ids for r in reqs]
        if cache:
            assert sum(evicted) > 0, "the pool was meant to be small enough to force eviction"
            assert sum(r.prefix_len for r in reqs) > 0
        for r in reqs:
            assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)
    assert outputs[True] == outputs[False]
