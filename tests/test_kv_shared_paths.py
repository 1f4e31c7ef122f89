"""A layer that attends to K/V another layer's cache returned (Gemma 4's KV-shared layers) is
found at load (``CacheLayout.shares_kv``) and kept off the paged decode, whose caches return
only the step's new K/V (the kernel reads the pool when the attention call reaches the cache;
a shared layer's call reaches none). The kernel path runs on the CPU here with the CUDA kernels
replaced by their reference computations (``test_paged_attention._reference_kernels``).
"""

from __future__ import annotations

import random

import pytest
from factory_shapes import HEAD_DIM, HEADS, KV_HEADS
from harness import InProcessService
from model_factory import load_cached, make_model
from near_tie import assert_requests_like_mlx
from test_paged_attention import _reference_kernels

from runtime.worker.model.discovery import AttentionShape, discover


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(3, 250) for _ in range(4 + 3 * i)] for i in range(n)]


@pytest.mark.parametrize("arch", ["llama", "hunyuan", "falcon_h1"])
def test_models_that_share_no_kv_are_not_marked(arch, model_dir):
    """Hunyuan's second layer reuses the first one's K/V projections but stores its K/V through
    its own cache; Falcon-H1's caches are CacheLists: neither shares fetched K/V."""
    model, _ = load_cached(model_dir(arch))
    assert not discover(model).shares_kv


@pytest.fixture(scope="module")
def shared_full_gemma4(tmp_path_factory):
    """Gemma 4 with full-attention layers only (one shape, no window) whose last two layers
    share the K/V of the first two: without the sharing, a model the paged decode would take."""
    return make_model("gemma4_text", tmp_path_factory.mktemp("gemma4_full"), layer_types=["full_attention"] * 4)


@pytest.mark.parametrize("row_cache", [None, False], ids=["default", "pool-gather"])
def test_kv_shared_model_does_not_take_the_paged_decode(shared_full_gemma4, row_cache, monkeypatch):
    """With the CUDA kernels replaced by their reference computations (the kernel path's
    bookkeeping on the CPU), a KV-shared model stays off the paged decode, whose caches return
    only the step's new K/V (a shared layer would attend to the new token alone), and is exact."""
    _reference_kernels(monkeypatch)
    folder = shared_full_gemma4
    model, _ = load_cached(folder)
    layout = discover(model)
    assert layout.kv_shape == AttentionShape(HEADS, KV_HEADS, 2 * HEAD_DIM) and not layout.windowed and layout.routed
    assert layout.shares_kv
    svc = InProcessService(folder, max_running=8, row_cache=row_cache)
    paths = svc.engine.paths
    assert paths.attention is None and paths.tail is None and paths.device_table is None
    assert (paths.row_cache is None) == (row_cache is False)
    rng = random.Random(3)
    first = [svc.request(f"a{i}", p, 8) for i, p in enumerate(_prompts(rng, KV_HEADS))]
    svc.run({0: first})
    again = svc.request("again", list(first[1].prompt_ids), 6)
    more = [svc.request(f"b{i}", p, 8) for i, p in enumerate(_prompts(rng, HEADS))]
    svc.run({0: [again] + more})
    assert again.prefix_len == len(again.prompt_ids) - 1
    assert_requests_like_mlx(folder, first + [again] + more)
