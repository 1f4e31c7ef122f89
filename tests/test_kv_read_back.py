"""Layers that read another layer's K/V back through its cache (``cache.keys_and_values()``).

Gemma 3n's last ``num_kv_shared_layers`` layers are handed the cache object of the last earlier
layer of their type and, after that layer stored this forward's K/V, attend to
``keys_and_values()``. The runtime's caches answer with what their ``update_and_fetch``
returned this forward (every position the layer attends to on the row cache, compiled or not,
and on the pool gather); the paged decode returns only the step's new K/V, so such a model is
kept off it (``CacheLayout.shares_kv``). Gemma 3n also takes one RoPE offset for the whole
forward from ``cache[0].offset``, before any layer updated it: the runtime's offsets do not
advance within a forward and are one per row in batched decode, so rows at different
positions, past the sliding window (8 here), decode together exactly.

AFM's KV-reuse layers read ``cache[-1].keys_and_values()`` too, but rotate their queries by
``keys.shape[2] - L``: one host number for every row, where batched decode attends to K/V padded
to a common, bucketed length; it stays refused (``forward_probe``).
"""

from __future__ import annotations

import random
from dataclasses import replace

import mlx.core as mx
import pytest
from factory_shapes import HEADS, KV_HEADS
from harness import InProcessService
from model_factory import load_cached
from near_tie import assert_requests_like_mlx
from test_paged_attention import _reference_kernels

from runtime.worker.model.discovery import UnsupportedModel, discover
from runtime.worker.paths.attention_paths import AttentionPaths
from runtime.worker.paths.pool_cache import CacheStandIn, ForwardBatch, PoolLayerCache
from runtime.worker.pools.kv_pool import KVPool

WINDOW = 8  # the factory's Gemma 3n sliding window


def _prompt(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def test_gemma3n_is_found_reading_kv_back(model_dir):
    """Two cache entries (a sliding and a full layer) for four layers; the last two read the
    first two's K/V back, which marks the layout as sharing K/V."""
    model, _ = load_cached(model_dir("gemma3n"))
    layout = discover(model)
    assert layout.attention_layers == (0, 1) and layout.windows == (WINDOW, None)
    assert layout.shares_kv and layout.routed


@pytest.mark.parametrize(("compiled", "row_cache"), [(True, None), (False, None), (False, False)],
                         ids=["row-cache-compiled", "row-cache-eager", "pool-gather"])
def test_gemma3n_exact_on_every_path(compiled, row_cache, model_dir):
    """Batched decode at the KV-head and head counts with rows at different positions past the
    window, then prefix hits (one a whole-prompt hit) decoding beside new rows."""
    folder = model_dir("gemma3n")
    svc = InProcessService(folder, max_running=8, compile_decode=compiled, row_cache=row_cache)
    paths = svc.engine.paths
    on_cpu = mx.default_device().type == mx.DeviceType.cpu  # compiled decode is the CPU's
    assert (svc.engine.compiled is not None) == (compiled and on_cpu) and (paths.row_cache is None) == (row_cache is False)
    assert paths.attention is None
    rng = random.Random(11)
    first = [svc.request(f"a{i}", _prompt(rng, 3 + 4 * i), 12) for i in range(KV_HEADS)]
    svc.run({0: first})
    shared = list(first[-1].prompt_ids)
    suffix = svc.request("suffix", shared + _prompt(rng, 5), 9)
    repeat = svc.request("repeat", list(first[0].prompt_ids), 10)
    more = [svc.request(f"b{i}", _prompt(rng, 2 + 5 * i), 9) for i in range(HEADS - 2)]
    svc.run({0: [suffix, repeat] + more})
    assert suffix.prefix_len >= len(shared) and repeat.prefix_len == len(repeat.prompt_ids) - 1
    assert_requests_like_mlx(folder, first + [suffix, repeat] + more)


def test_gemma3n_chunked_prefill_past_the_window(model_dir):
    """Prompts longer than the window, prefilled in chunks of 5 (each chunk's shared layers
    read back the prefix and the chunk), several chunks in one step."""
    folder = model_dir("gemma3n")
    svc = InProcessService(folder, max_running=8, prefill_chunk=5, max_step_tokens=12)
    rng = random.Random(4)
    reqs = [svc.request(f"c{i}", _prompt(rng, 9 + 7 * i), 7) for i in range(3)]
    svc.run({0: reqs})
    assert_requests_like_mlx(folder, reqs)


def test_gemma3n_takes_no_paged_decode(model_dir, monkeypatch):
    """With the CUDA kernels replaced by their reference computations, Gemma 3n decodes on the
    row cache or the pool gather, exact; and with its windows set aside, reading K/V back alone
    keeps it off the paged decode (which the same layout without it would take)."""
    _reference_kernels(monkeypatch)
    folder = model_dir("gemma3n")
    svc = InProcessService(folder, max_running=8, row_cache=False)
    assert svc.engine.paths.attention is None and svc.engine.paths.tail is None
    rng = random.Random(5)
    reqs = [svc.request(f"p{i}", _prompt(rng, 4 + 5 * i), 8) for i in range(KV_HEADS)]
    svc.run({0: reqs})
    assert_requests_like_mlx(folder, reqs)

    model, _ = load_cached(folder)
    layout = replace(discover(model), windows=())
    pool = KVPool(len(layout.attention_layers), 64, layout.kv_shapes, layout.kv_dtype)

    def paths(shares_kv: bool) -> AttentionPaths:
        return AttentionPaths(model, replace(layout, shares_kv=shares_kv), pool, 4, 64, row_cache=False)

    assert paths(True).attention is None
    assert paths(False).attention is not None


def test_a_paged_view_returns_no_full_kv(model_dir, monkeypatch):
    """``keys_and_values()`` is what ``update_and_fetch`` returned where that is every attended
    position (the pool gather); a paged view's update returns the new K/V alone, and reading
    them back fails rather than attending to the new token only."""
    _reference_kernels(monkeypatch)
    from runtime.worker.paths.paged_attention import PagedAttention

    shape = discover(load_cached(model_dir("llama"))[0]).kv_shapes[0]
    pool = KVPool(1, 16, shape, mx.float32)
    keys = mx.ones((1, shape.n_kv_heads, 1, shape.head_dim))
    gather = mx.array([[1, 2, 3]], dtype=mx.int32)
    batch = ForwardBatch(write_slots=mx.array([3], dtype=mx.int32), gather_index=gather, offset=2, mask=None)
    view = PoolLayerCache(pool, 0, batch)
    fetched = view.update_and_fetch(keys, keys)
    assert fetched[0].shape[2] == 3 and view.keys_and_values() is fetched
    paged = PoolLayerCache(pool, 0, replace(batch, attention=PagedAttention(False), lengths=mx.array([3])))
    assert paged.update_and_fetch(keys, keys)[0].shape[2] == 1
    with pytest.raises(AssertionError, match="no full K/V"):
        paged.keys_and_values()
    with pytest.raises(AssertionError):
        CacheStandIn().keys_and_values()


def test_afm_is_refused_for_its_host_number_rope_offset(model_dir):
    """AFM's KV-reuse layers rotate queries by the length of the K/V they read back."""
    with pytest.raises(UnsupportedModel, match="gives RoPE one position for rows at different positions"):
        discover(load_cached(model_dir("afm7"))[0])


@pytest.mark.skipif(mx.default_device().type != mx.DeviceType.cpu,
                    reason="the loader transposes weights only for the CPU's reference BLAS (loader.slow_blas)")
def test_a_transposed_linear_takes_a_weight_assigned_in_the_forward():
    """Gemma 3n's AltUp assigns its coefficient layers' ``weight`` (cast and clipped) every
    forward; a layer the loader transposed (``TransposedLinear``, reference BLAS) then computes
    ``nn.Linear``'s product over that weight, bit for bit."""
    import mlx.nn as nn

    from runtime.worker.model.transposed_linear import TransposedLinear

    linear = nn.Linear(6, 5, bias=False)
    layer = TransposedLinear(mx.contiguous(linear.weight.T))
    x = mx.random.normal((3, 6), key=mx.random.key(1))
    assert mx.array_equal(layer(x), linear(x)).item()
    layer.weight = mx.clip(layer.weight, -0.1, 0.1)
    linear.weight = mx.clip(linear.weight, -0.1, 0.1)
    assert "weight_t" not in layer and mx.array_equal(layer.weight, linear.weight).item()
    assert mx.array_equal(layer(x), linear(x)).item()
