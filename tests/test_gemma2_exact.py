"""Gemma2 (queries grouped in 5-D, attention by hand) token-exact against mlx-lm when batched.

Gemma2 reshapes queries to (B, n_kv_heads, n_rep, L, head_dim) and adds the mask to scores of
that rank; a (B, 1, 1, T) decode mask there crashes, or, with a batch the size of the KV-head
count, broadcasts the batch against the KV heads and every row is wrong. One row needs no
mask, so only batched decode shows it (SPEC 7.3).

Every family of the model factory then decodes batched here; the families with no test file of
their own (``PLAIN_FAMILIES``) also run one request and prefix-cache hits here.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from harness import InProcessService
from model_factory import ARCHS, HEADS, KV_HEADS, REFUSED, load_cached, reference_greedy

from runtime.worker.model.discovery import UnsupportedModel, discover

BATCH_SIZES = sorted({1, 2, KV_HEADS, HEADS, 5})


def _prompts(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(3, 250) for _ in range(4 + 3 * i)] for i in range(n)]


def test_discovery_records_the_grouped_query_layout(model_dir):
    from runtime.worker.paths.pool_cache import decode_mask

    gemma2, _ = load_cached(model_dir("gemma2"))
    llama, _ = load_cached(model_dir("llama"))
    assert discover(gemma2).mask_rank == 5
    assert discover(llama).mask_rank == 4
    valid = mx.array([[True, False], [True, True], [False, True]])
    assert decode_mask(valid, 5).shape == (3, 1, 1, 1, 2)
    assert decode_mask(valid, 4).shape == (3, 1, 1, 2)


@pytest.mark.parametrize("row_cache", [None, False], ids=["row-cache", "pool-gather"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_batched_decode_is_exact(batch, compiled, row_cache, model_dir):
    folder = model_dir("gemma2")
    svc = InProcessService(folder, max_running=8, compile_decode=compiled, row_cache=row_cache)
    assert (svc.engine.compiled is not None) == (compiled and row_cache is None)
    reqs = [svc.request(f"r{i}", p, 10) for i, p in enumerate(_prompts(batch, batch))]
    svc.run({0: reqs})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_batched_decode_after_prefix_hits_is_exact(compiled, model_dir):
    """Rows that share a cached prefix (one a whole-prompt hit), decoded together with rows at
    other positions."""
    folder = model_dir("gemma2")
    svc = InProcessService(folder, max_running=8, compile_decode=compiled)
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    first = [svc.request(f"a{i}", shared + [rng.randrange(3, 250) for _ in range(2 + i)], 8) for i in range(3)]
    svc.run({0: first})
    second = [svc.request(f"b{i}", shared[: 12 + 3 * i] + [rng.randrange(3, 250) for _ in range(3)], 9)
              for i in range(3)]
    repeat = svc.request("repeat", list(first[0].prompt_ids), 7)
    svc.run({0: second + [repeat]})
    assert all(r.prefix_len > 0 for r in second) and repeat.prefix_len == len(repeat.prompt_ids) - 1
    for r in first + second + [repeat]:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid




@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("arch", ARCHS)
def test_every_family_batched_decode_at_head_count_batch_sizes(arch, compiled, model_dir):
    """Batch sizes 2, the KV-head count, the head count and 5, all decoding together, for
    every architecture the runtime serves (a refusal at load is allowed, a wrong token is not)."""
    folder = model_dir(arch)
    if arch in REFUSED:  # served nowhere: the refusal itself must be clear
        with pytest.raises(UnsupportedModel, match=REFUSED[arch]):
            InProcessService(folder, max_running=8, compile_decode=compiled, aux_slots=64)
        return
    svc = InProcessService(folder, max_running=8, compile_decode=compiled, aux_slots=64)
    for batch in sorted({2, KV_HEADS, HEADS, 5}):
        reqs = [svc.request(f"{batch}-{i}", p, 8) for i, p in enumerate(_prompts(10 + batch, batch))]
        svc.run({0: reqs})
        for r in reqs:
            assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), (batch, r.rid)


# Families issue 18 asks to keep checking, with no file of their own: decoders whose attention
# discovery finds as it finds llama's (GQA, q/k norms, biases, NoPE layers, partial or NTK
# RoPE, muP-style scales, MoE MLPs; Hunyuan's second layer reuses the first one's K/V
# projections), and Mamba v1 (recurrent state only). Batched decode: the test above.
PLAIN_FAMILIES = ("mistral", "qwen2", "qwen3_moe", "mixtral", "gemma", "olmo2", "granite", "minicpm",
                  "starcoder2", "smollm3", "glm4", "ernie4_5", "hunyuan", "hunyuan_v1_dense", "mamba")
TRACK_CHUNK = 8  # a recurrent family reuses a prefix at multiples of this


@pytest.mark.parametrize("arch", PLAIN_FAMILIES)
def test_plain_family_one_request_then_prefix_hits(arch, model_dir):
    """One request alone, then a new suffix on its cached prefix and an exact repeat of it (a
    whole-prompt hit), decoded together."""
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, aux_slots=64, track_chunk=TRACK_CHUNK)
    rng = random.Random(7)
    shared = [rng.randrange(3, 250) for _ in range(2 * TRACK_CHUNK)]
    first = svc.request("first", shared + [rng.randrange(3, 250) for _ in range(3)], 8)
    svc.run({0: [first]})
    suffix = svc.request("suffix", shared + [rng.randrange(3, 250) for _ in range(4)], 6)
    repeat = svc.request("repeat", list(first.prompt_ids), 6)
    svc.run({0: [suffix, repeat]})
    assert suffix.prefix_len >= len(shared) and repeat.prefix_len == len(repeat.prompt_ids) - 1, \
        (suffix.prefix_len, repeat.prefix_len)
    for r in (first, suffix, repeat):
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
