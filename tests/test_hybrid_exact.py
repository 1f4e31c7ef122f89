"""Hybrid models (gated delta-net, Mamba-2) token-exact against mlx-lm, with and without prefix hits."""

from __future__ import annotations

import random

import pytest
from conftest import running_service
from harness import InProcessService
from model_factory import reference_greedy

from runtime.client import Client
from runtime.scheduler.tokenizer import Tokenizer

HYBRIDS = ["qwen3_next", "qwen3_5", "mamba2"]


@pytest.fixture(params=HYBRIDS)
def folder(request, model_dir):
    return model_dir(request.param)


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def test_single_request(folder):
    svc = InProcessService(folder, aux_slots=16)
    prompt = _ids(random.Random(1), 37)
    r = svc.request("one", prompt, 20)
    svc.run({0: [r]})
    assert r.output_ids == reference_greedy(folder, prompt, 20)


def test_the_eager_row_cache_step_keeps_a_steady_batchs_states(folder):
    """The uncompiled decode (Metal's row-cache path; ``compile_decode = false``): states stay
    resident between steps and go back to the pool as requests join and finish."""
    svc = InProcessService(folder, aux_slots=64, compile_decode=False, track_chunk=8)
    assert svc.engine.compiled is None and svc.engine.compiled_paged is None  # (mamba2: no attention, no row cache)
    rng = random.Random(1)
    reqs = [svc.request(f"r{i}", _ids(rng, 9 + 5 * i), 6 + 3 * i) for i in range(4)]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    assert svc.engine.aux_pool.resident_slots is not None  # the last batch's states, still resident
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_eight_concurrent_then_prefix_hits_at_chunk_boundaries(folder):
    svc = InProcessService(folder, aux_slots=64, track_chunk=16, prefill_chunk=48)
    rng = random.Random(3)
    shared = _ids(rng, 40)
    cold, arrivals = [], {}
    for i in range(8):
        # Shared-prefix prompts of 41-47 tokens keep their state at 32, the last multiple of 16.
        prompt = shared + _ids(rng, rng.randint(1, 7)) if i % 2 else _ids(rng, rng.randint(1, 50))
        r = svc.request(f"c{i}", prompt, rng.randint(1, 20))
        cold.append(r)
        arrivals.setdefault(rng.randint(0, 12), []).append(r)
    svc.run(arrivals)
    # Second wave: new suffixes on the shared prefix, and exact repeats.
    warm = [svc.request(f"w{i}", shared + _ids(rng, 5 + i), 10) for i in range(4)]
    warm += [svc.request(f"x{i}", r.prompt_ids, r.max_new) for i, r in enumerate(cold[:4])]
    svc.run({0: warm[:4], 2: warm[4:]})
    for r in cold + warm:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
    hits = [r.prefix_len for r in warm[:4]]
    assert hits == [32, 32, 32, 32], hits  # reused at a chunk boundary
    for r, again in zip(cold[:4], warm[4:]):
        assert again.prefix_len == r.prompt_len - 1  # exact repeat: full-prompt hit
    aux = svc.sched.aux
    assert aux.slots.free_count + len(svc.sched.tree.owned_aux_slots()) == aux.slots.capacity


def test_a_system_prompt_is_restored_from_the_third_request_on(folder):
    """A 70-token system prompt, then each request's own 30: the first keeps states only in its
    own text (96, 99); the second, matching 70 tokens it cannot restore, keeps the state at 70;
    the rest restore it. Every reply stays mlx-lm's."""
    svc = InProcessService(folder, aux_slots=64, track_chunk=16, prefill_chunk=48)
    rng = random.Random(5)
    system = _ids(rng, 70)
    reqs = [svc.request(f"s{i}", system + _ids(rng, 30), 6) for i in range(4)]
    svc.run({0: reqs[:1]})
    svc.run({0: reqs[1:2]})
    svc.run({0: reqs[2:]})
    assert [r.prefix_len for r in reqs] == [0, 0, 70, 70]
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
    aux = svc.sched.aux
    assert aux.slots.free_count + len(svc.sched.tree.owned_aux_slots()) == aux.slots.capacity


def test_cache_off_matches_cache_on(folder):
    rng = random.Random(8)
    shared = _ids(rng, 30)
    prompts = [shared + _ids(rng, rng.randint(1, 20)) for _ in range(6)]
    outs = {}
    for cache in (True, False):
        svc = InProcessService(folder, aux_slots=32, track_chunk=8, cache=cache)
        reqs = [svc.request(f"r{i}", p, 8) for i, p in enumerate(prompts)]
        svc.run({i: [r] for i, r in enumerate(reqs)})
        outs[cache] = [r.output_ids for r in reqs]
        if not cache:
            assert svc.sched.aux.slots.free_count == svc.sched.aux.slots.capacity
    assert outs[True] == outs[False]


async def test_a_chat_system_prompt_is_restored_from_the_second_chat_on(model_dir, tmp_path):
    """Through the service: the first chat keeps the state where its system message ends, so the
    second chat with that system message reads it from the cache."""
    folder = model_dir("qwen3_next")
    system = {"role": "system", "content": " ".join(["the cat sat on the mat"] * 8)}
    extra = "[cache]\nkv_slots = 2048\naux_slots = 32\ntrack_chunk = 16\n[scheduler]\nmax_running = 8\nmax_context = 512\n"
    with running_service(tmp_path, folder, extra) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            first = await client.chat([system, {"role": "user", "content": "a dog ran"}], max_tokens=4,
                                      ignore_eos=True)
            second = await client.chat([system, {"role": "user", "content": "my bird sang a song"}],
                                       max_tokens=4, ignore_eos=True)
    tok = Tokenizer(str(folder))._tok
    alone = tok.apply_chat_template([system], add_generation_prompt=False, tokenize=True, return_dict=False)
    assert first.error is None and second.error is None
    assert first.cached_tokens == 0 and second.cached_tokens == len(alone) >= 16
    ids = tok.apply_chat_template([system, {"role": "user", "content": "my bird sang a song"}],
                                  add_generation_prompt=True, tokenize=True, return_dict=False)
    assert second.token_ids == reference_greedy(folder, list(ids), 4)  # from the restored state


async def test_hybrid_through_the_service(model_dir, tmp_path):
    folder = model_dir("qwen3_next")
    rng = random.Random(4)
    shared = _ids(rng, 70)
    extra = "[cache]\nkv_slots = 2048\naux_slots = 32\ntrack_chunk = 64\n[scheduler]\nmax_running = 8\nmax_context = 256\n"
    with running_service(tmp_path, folder, extra) as svc:
        async with Client(svc.address, timeout_s=60) as client:
            first = await client.generate(token_ids=shared + [5], max_tokens=6, ignore_eos=True)
            # Shares 66 tokens with the first: the state saved after 64 is reused.
            second = await client.generate(token_ids=shared[:66] + [9, 9], max_tokens=6, ignore_eos=True)
            status = await client.status()
    assert first.cached_tokens == 0 and second.cached_tokens == 64
    assert first.token_ids == reference_greedy(folder, shared + [5], 6)
    assert second.token_ids == reference_greedy(folder, shared[:66] + [9, 9], 6)
    assert status.aux_slots_free + status.aux_slots_cached == status.aux_slots_total
    assert status.running == 0
