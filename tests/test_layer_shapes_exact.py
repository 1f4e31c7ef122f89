"""Models whose attention layers have different K/V shapes or query-head counts, token-exact.

Gemma 4 (global layers twice as wide as its sliding ones; its last layers share the K/V of
earlier ones), OpenELM (head counts growing with depth), Step 3.5 (sliding layers with twice
the query heads) and MiMo-V2-Flash (sliding layers with twice the KV heads, keys wider than
values): discovery records each layer's shape, the KV pool and the row cache store each layer at
its own, and the paged decode (which reads one shape) is not taken. ``test_gemma2_exact`` and
``test_more_families_exact`` run these families on the default path; here they also run on the
pool-gather path, at batch sizes equal to every layer's head counts.
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from factory_shapes import HEAD_DIM, HEADS, KV_HEADS
from harness import InProcessService
from model_factory import load_cached, make_model
from near_tie import assert_requests_like_mlx

from runtime.worker.model.discovery import AttentionShape, discover
from runtime.worker.paths.rows.row_cache import RowCache
from runtime.worker.pools.kv_pool import KVPool

ON_CPU = mx.default_device().type == mx.DeviceType.cpu  # compiled decode is the CPU's (a GPU runs these uncompiled)

S = AttentionShape
# Each KV-pool layer's shape in the factory's tiny configs, and whether a layer shares K/V.
SHAPES = {
    "gemma4_text": ((S(HEADS, KV_HEADS, HEAD_DIM), S(HEADS, KV_HEADS, 2 * HEAD_DIM)), True),
    "openelm": ((S(4, 2, HEAD_DIM), S(8, 4, HEAD_DIM)), False),
    "step3p5": ((S(HEADS, KV_HEADS, HEAD_DIM), S(2 * HEADS, KV_HEADS, HEAD_DIM)) * 2, False),
    "mimo_v2_flash": ((S(HEADS, 1, 24, 16), S(HEADS, KV_HEADS, 24, 16), S(HEADS, KV_HEADS, 24, 16),
                       S(HEADS, 1, 24, 16)), False),
}
ARCHS = sorted(SHAPES)


@pytest.mark.parametrize("arch", ARCHS)
def test_discovery_records_each_layers_shape(arch, model_dir):
    model, _ = load_cached(model_dir(arch))
    layout = discover(model)
    shapes, shared = SHAPES[arch]
    assert layout.kv_shapes == shapes and layout.kv_shape is None
    assert layout.shares_kv == shared and layout.mask_rank == 4


@pytest.mark.parametrize("arch", ["llama", "hunyuan"])
def test_uniform_models_keep_their_one_shape(arch, model_dir):
    """Hunyuan's second layer reuses the first one's K/V projections but stores its K/V through
    its own cache: not KV sharing."""
    model, _ = load_cached(model_dir(arch))
    layout = discover(model)
    assert layout.kv_shape == S(HEADS, KV_HEADS, HEAD_DIM) and layout.kv_shapes == (layout.kv_shape,) * 2
    assert not layout.shares_kv


def test_pool_and_row_cache_store_each_layer_at_its_shape():
    shapes = (S(4, 1, 24, 16), S(4, 2, 16), S(8, 4, 32))
    pool = KVPool(3, 5, shapes, mx.float32)
    assert [k.shape for k in pool.keys] == [(5, 1, 24), (5, 2, 16), (5, 4, 32)]
    assert [v.shape for v in pool.values] == [(5, 1, 16), (5, 2, 16), (5, 4, 32)]
    assert pool.shape is None and KVPool(2, 5, S(4, 2, 16), mx.float32).shape == S(4, 2, 16)
    per_slot = (1 * (24 + 16) + 2 * 32 + 4 * 64) * 4
    assert KVPool.bytes_per_slot(3, shapes, mx.float32) == per_slot == pool.nbytes // 5
    rows = RowCache(3, 2, 6, shapes, mx.float32)
    assert [k.shape for k in rows.keys] == [(2, 1, 7, 24), (2, 2, 7, 16), (2, 4, 7, 32)]
    assert [v.shape[-1] for v in rows.values] == [16, 16, 32] and [h.shape for h in rows.heads] == [(1, 1), (1, 2), (1, 4)]
    assert RowCache.nbytes_for(3, 2, 6, shapes, mx.float32) == 2 * 7 * per_slot
    # A decode step's K/V reach the pool through the row cache at every layer's own shape.
    for layer, s in enumerate(shapes):
        rows.keys[layer][1, :, 3, :] = mx.full((s.n_kv_heads, s.head_dim), layer + 1.0)
        rows.values[layer][1, :, 3, :] = mx.full((s.n_kv_heads, s.value_width), -layer - 1.0)
    rows.flush(pool, mx.array([1]), mx.array([3]), mx.array([4]))
    for layer in range(3):
        assert (pool.keys[layer][4] == layer + 1).all().item() and (pool.values[layer][4] == -layer - 1).all().item()
        assert (pool.keys[layer][:4] == 0).all().item()


def test_loader_sizes_the_pool_over_every_layers_shape(model_dir, monkeypatch):
    from runtime.worker import loader

    seen = []
    choose = loader.defaults.choose
    monkeypatch.setattr(loader.defaults, "choose", lambda *a: seen.append(a[3]) or choose(*a))
    svc = InProcessService(model_dir("gemma4_text"), max_running=4)
    # Layer 0: 2 KV heads x (16 + 16) floats; layer 1: 2 x (32 + 32); the shared layers none.
    assert seen == [(2 * 32 + 2 * 64) * 4]
    assert svc.pool.nbytes == seen[0] * svc.pool.num_slots


def _prompts(rng: random.Random, n: int) -> list[list[int]]:
    return [[rng.randrange(3, 250) for _ in range(4 + 3 * i)] for i in range(n)]


def _batch_sizes(arch: str) -> list[int]:
    """1, 2 and every head count of every layer (a mask of the wrong layout broadcasts the
    batch against a head axis only at these sizes)."""
    shapes, _ = SHAPES[arch]
    return sorted({1, 2} | {s.n_heads for s in shapes} | {s.n_kv_heads for s in shapes})


@pytest.mark.parametrize("path", ["compiled", "row-cache", "pool-gather"])
@pytest.mark.parametrize("arch", ARCHS)
def test_batched_decode_at_every_layers_head_counts(arch, path, model_dir):
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, row_cache=path != "pool-gather",
                           compile_decode=path == "compiled")
    assert (svc.engine.compiled is not None) == (path == "compiled" and ON_CPU)
    assert (svc.engine.paths.row_cache is not None) == (path != "pool-gather")
    assert svc.engine.paths.attention is None, "layers of several shapes never take the paged decode"
    rng = random.Random(11)
    for batch in _batch_sizes(arch):
        reqs = [svc.request(f"{batch}-{i}", p, 8) for i, p in enumerate(_prompts(rng, batch))]
        svc.run({0: reqs})
        assert_requests_like_mlx(folder, reqs)


@pytest.mark.parametrize("arch", ARCHS)
def test_pool_gather_prefix_hits_and_chunks(arch, model_dir):
    """A new suffix on a cached prefix, a whole-prompt hit and a prompt prefilled in chunks,
    decoded together on the pool-gather path."""
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, row_cache=False, prefill_chunk=8, max_step_tokens=16)
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    first = svc.request("first", shared + [rng.randrange(3, 250) for _ in range(3)], 8)
    svc.run({0: [first]})
    suffix = svc.request("suffix", shared + [rng.randrange(3, 250) for _ in range(4)], 9)
    repeat = svc.request("repeat", list(first.prompt_ids), 7)
    long = svc.request("long", [rng.randrange(3, 250) for _ in range(30)], 6)
    svc.run({0: [suffix, repeat, long]})
    assert suffix.prefix_len >= len(shared) and repeat.prefix_len == len(repeat.prompt_ids) - 1
    assert_requests_like_mlx(folder, [first, suffix, repeat, long])


def test_layers_of_different_kv_dtypes_are_still_refused(model_dir):
    from mlx.utils import tree_map
    from mlx_lm.utils import load_model

    from runtime.worker.model.discovery import UnsupportedModel

    model, _ = load_model(model_dir("llama"))  # not the cached one: one layer is cast
    attention = model.layers[1].self_attn
    attention.update(tree_map(lambda a: a.astype(mx.float16), attention.parameters()))
    with pytest.raises(UnsupportedModel, match="store K/V of different dtypes"):
        discover(model)


@pytest.fixture(scope="module")
def gemma4_moe_k_eq_v(tmp_path_factory):
    """Gemma 4 in its 26B layout: global layers whose values are their keys' projection
    (``attention_k_eq_v``) with fewer KV heads (``num_global_key_value_heads``) and wider heads
    than the sliding layers, routed experts beside the MLP, no KV sharing."""
    return make_model("gemma4_text", tmp_path_factory.mktemp("gemma4_moe"), num_kv_shared_layers=0,
                      use_double_wide_mlp=False, hidden_size_per_layer_input=0, attention_k_eq_v=True,
                      num_global_key_value_heads=1, enable_moe_block=True, num_experts=4, top_k_experts=2,
                      moe_intermediate_size=32)


@pytest.mark.parametrize("path", ["compiled", "pool-gather"])
def test_gemma4_global_kv_heads_and_k_eq_v(gemma4_moe_k_eq_v, path):
    folder = gemma4_moe_k_eq_v
    model, _ = load_cached(folder)
    layout = discover(model)
    sliding, full = S(HEADS, KV_HEADS, HEAD_DIM), S(HEADS, 1, 2 * HEAD_DIM)
    assert layout.kv_shapes == (sliding, full) * 2 and not layout.shares_kv
    svc = InProcessService(folder, max_running=8, row_cache=path != "pool-gather")
    assert (svc.engine.compiled is not None) == (path == "compiled" and ON_CPU)
    rng = random.Random(9)
    shared = [rng.randrange(3, 250) for _ in range(12)]
    first = svc.request("first", shared + [rng.randrange(3, 250) for _ in range(2)], 8)
    svc.run({0: [first]})
    reqs = [svc.request("repeat", list(first.prompt_ids), 6),
            svc.request("suffix", shared + [rng.randrange(3, 250) for _ in range(3)], 8)]
    reqs += [svc.request(f"r{i}", p, 8) for i, p in enumerate(_prompts(rng, HEADS))]
    svc.run({0: reqs})
    assert reqs[0].prefix_len == len(reqs[0].prompt_ids) - 1 and reqs[1].prefix_len >= len(shared)
    assert_requests_like_mlx(folder, [first] + reqs)


def test_loader_sizes_the_state_pool_from_its_slots_bytes(model_dir, monkeypatch):
    from runtime.worker import loader
    from runtime.worker.pools.aux_pool import AuxPool

    seen = []
    choose = loader.defaults.choose
    monkeypatch.setattr(loader.defaults, "choose", lambda *a: seen.append(a[4]) or choose(*a))
    svc = InProcessService(model_dir("qwen3_next"), max_running=4, aux_slots=0)
    states = svc.engine.aux_pool.arrays()
    assert seen == [AuxPool.bytes_per_slot([[(s.shape[1:], s.dtype)] for s in states])] and seen[0] > 0
    assert all(s.shape[0] == 8 * 4 + 1 for s in states)  # 8 a row, and the reserved slot
