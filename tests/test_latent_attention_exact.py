"""Multi-head latent attention (DeepSeek-V2 / V3) token-exact against mlx-lm.

mlx-lm's DeepSeek-V2 caches per-head keys (no-RoPE part + rotary part, 24 wide here) and
values of another width (16); DeepSeek-V3 caches one 32-wide latent as "keys" and the 8-wide
rotary key as "values", one head for all queries, and attends by hand around its module's
attention call: in prefill it expands the latent into per-head keys and values, in decode it
attends in latent space, and the rotary scores reach that call as an additive float mask.
The pool (and the row cache) store keys and values at their own widths; V3's attention is
not routed to a paged decode (``CacheLayout.routed``), so it runs where its cache returns
every position's K/V.

Each family on each CPU path (compiled row cache, eager row cache, pool gather): several
requests at once (batch sizes 1, 2, the KV-head count and more, of different lengths, some
joining a running batch), and prefix-cache hits (one a whole-prompt hit).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from harness import InProcessService
from model_factory import HEADS, load_cached
from near_tie import assert_requests_like_mlx

from runtime.worker.model.discovery import discover
from runtime.worker.pools.kv_pool import KVPool

# (n_kv_heads, stored key width, stored value width, routed) of the tiny models (model_factory).
GEOMETRY = {"deepseek_v2": (HEADS, 24, 16, True), "deepseek_v3": (1, 32, 8, False),
            "glm4_moe_lite": (1, 32, 8, False)}
PATHS = {"compiled": dict(compile_decode=True), "eager": dict(compile_decode=False),
         "pool-gather": dict(compile_decode=False, row_cache=False)}


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]



@pytest.mark.parametrize("arch", sorted(GEOMETRY))
def test_discovery_records_key_and_value_widths(arch, model_dir):
    model, _ = load_cached(model_dir(arch))
    layout = discover(model)
    n_kv, key_width, value_width, routed = GEOMETRY[arch]
    shape = layout.kv_shape
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim, shape.value_width) == (HEADS, n_kv, key_width, value_width)
    assert layout.routed == routed and not shape.same_widths
    pool = KVPool(len(layout.attention_layers), 8, shape, layout.kv_dtype)
    assert pool.keys[0].shape == (8, n_kv, key_width) and pool.values[0].shape == (8, n_kv, value_width)
    assert KVPool.bytes_per_slot(2, shape, layout.kv_dtype) == 2 * n_kv * (key_width + value_width) * 4


@pytest.mark.parametrize("path", sorted(PATHS))
@pytest.mark.parametrize("arch", sorted(GEOMETRY))
def test_concurrent_requests_and_prefix_hits(arch, path, model_dir):
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, **PATHS[path])
    assert svc.engine.paths.attention is None  # never a paged decode: widths differ
    if mx.default_device().type == mx.DeviceType.cpu:  # compiled decode is the CPU's
        assert (svc.engine.compiled is not None) == (path == "compiled")
    assert path != "pool-gather" or svc.engine.paths.row_cache is None
    rng = random.Random(2)
    for batch in sorted({1, 2, GEOMETRY[arch][0], 5}):
        reqs = [svc.request(f"{batch}-{i}", _ids(rng, 3 + 5 * i), 6 + i) for i in range(batch)]
        svc.run({0: reqs[: max(batch - 1, 1)], 2: reqs[max(batch - 1, 1) :]})
        assert_requests_like_mlx(folder, reqs)
    shared = _ids(rng, 24)
    first = [svc.request(f"a{i}", shared + _ids(rng, 2 + i), 8) for i in range(2)]
    svc.run({0: first})
    second = [svc.request(f"b{i}", shared[: 12 + 6 * i] + _ids(rng, 3 + i), 7) for i in range(3)]
    repeat = svc.request("repeat", list(first[0].prompt_ids), 6)
    svc.run({0: second + [repeat]})
    assert [r.prefix_len for r in second] == [12, 18, 24] and repeat.prefix_len == len(repeat.prompt_ids) - 1
    assert_requests_like_mlx(folder, first + second + [repeat])
