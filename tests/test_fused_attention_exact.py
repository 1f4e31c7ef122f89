"""Attention that discovery finds by how it uses its KV cache, token-exact against mlx-lm.

Phi-3 projects q/k/v with one fused ``qkv_proj``; Bailing's attention lives in ``attention``
with a fused ``query_key_value`` and an output projection ``dense``; LFM2's attention layers
(between short-conv layers) project out through ``out_proj``; Nemotron-H's attention layers
(between Mamba layers, with MLP-only blocks that have no cache entry) use no RoPE. None of
them has the q/k/v/o projection names discovery once looked for; all of them store K/V
through ``cache.update_and_fetch`` and attend through mlx-lm's module-level
``scaled_dot_product_attention``, which is what discovery now recognises (``attention_probe``).
Falcon-H1 runs a Mamba mixer and attention side by side in every layer, whose cache is a
``CacheList`` of the two (``cache_entries``: one flat entry per part, nested back per forward).

Every family: one request, several at once (batch sizes 2, the KV-head count and more, of
different lengths, arriving at different steps), and prefix-cache hits, decode compiled and
not.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from harness import InProcessService
from model_factory import HEADS, KV_HEADS, load_cached, reference_greedy

from runtime.worker.model.discovery import discover

FAMILIES = ("phi3", "bailing_moe", "lfm2", "nemotron_h", "falcon_h1")
BATCH_SIZES = sorted({2, KV_HEADS, HEADS, 5})
TRACK_CHUNK = 8  # hybrid prefixes are reused at multiples of this


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def _service(folder, compiled: bool) -> InProcessService:
    svc = InProcessService(folder, max_running=8, compile_decode=compiled, aux_slots=64, track_chunk=TRACK_CHUNK)
    if not compiled or mx.default_device().type == mx.DeviceType.cpu:  # a GPU picks its own compiled paths
        assert (svc.engine.compiled is not None) == compiled
    return svc


def _check(folder, reqs) -> None:
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize("arch", FAMILIES)
def test_discovery_routes_every_attention_layer(arch, model_dir):
    """Each KV cache entry has its attention module, found without the q/k/v/o names."""
    model, _ = load_cached(model_dir(arch))
    layout = discover(model)
    assert layout.attention_layers and layout.kv_shape is not None
    assert (layout.kv_shape.n_heads, layout.kv_shape.n_kv_heads, layout.kv_shape.head_dim) == (HEADS, KV_HEADS, 16)
    assert sum(name is not None for name in layout.attn_attr) == len(layout.attention_layers)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_one_request(arch, compiled, model_dir):
    folder = model_dir(arch)
    svc = _service(folder, compiled)
    r = svc.request("one", _ids(random.Random(1), 23), 12)
    svc.run({0: [r]})
    _check(folder, [r])


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_concurrent_requests_of_different_lengths(arch, compiled, model_dir):
    """Rows at different positions decode together; the last ones join a running batch."""
    folder = model_dir(arch)
    svc = _service(folder, compiled)
    rng = random.Random(2)
    for batch in BATCH_SIZES:
        reqs = [svc.request(f"{batch}-{i}", _ids(rng, 3 + 5 * i), 6 + i) for i in range(batch)]
        svc.run({0: reqs[: batch - 1], 2: reqs[batch - 1 :]})
        _check(folder, reqs)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("arch", FAMILIES)
def test_prefix_cache_hits(arch, compiled, model_dir):
    """New suffixes on a cached prefix, and an exact repeat (a whole-prompt hit), decoded
    together; hybrids reuse the prefix at a tracking-chunk boundary."""
    folder = model_dir(arch)
    svc = _service(folder, compiled)
    rng = random.Random(3)
    shared = _ids(rng, 3 * TRACK_CHUNK)
    first = [svc.request(f"a{i}", shared + _ids(rng, 2 + i), 8) for i in range(2)]
    svc.run({0: first})
    second = [svc.request(f"b{i}", shared + _ids(rng, 3 + i), 7) for i in range(3)]
    repeat = svc.request("repeat", list(first[0].prompt_ids), 6)
    svc.run({0: second + [repeat]})
    assert all(r.prefix_len >= len(shared) for r in second), [r.prefix_len for r in second]
    assert repeat.prefix_len == len(repeat.prompt_ids) - 1
    _check(folder, first + second + [repeat])
