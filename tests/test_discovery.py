"""Model discovery (SPEC section 1): attention vs auxiliary layers, shapes, dtypes, refusals."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models.base import scaled_dot_product_attention
from mlx_lm.models.cache import KVCache
from model_factory import load_cached

from runtime.worker.model.attention_probe import compute_dtype, probe_attention
from runtime.worker.model.discovery import (
    UnsupportedModel,
    attention_shape,
    discover,
    find_attention,
    is_softmax_attention,
)


def test_llama_layout(model_dir):
    model, _ = load_cached(model_dir("llama"))
    layout = discover(model)
    assert layout.attention_layers == (0, 1) and layout.aux_layers == () and not layout.has_aux
    assert layout.kv_index == (0, 1) and layout.attn_attr == ("self_attn", "self_attn")
    assert layout.kv_shape.n_kv_heads == 2 and layout.kv_shape.head_dim == 16
    assert layout.kv_dtype == mx.float32


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_layout_separates_attention_from_aux(model_dir, arch):
    model, _ = load_cached(model_dir(arch))
    layout = discover(model)
    assert layout.num_layers == 4
    assert layout.attention_layers == (1, 3) and layout.aux_layers == (0, 2) and layout.has_aux
    assert layout.kv_index == (-1, 0, -1, 1)
    assert layout.attn_attr == (None, "self_attn", None, "self_attn")
    # The gated-delta mixer has projections but is not softmax attention.
    assert not is_softmax_attention(model.layers[0].linear_attn)


def test_gated_query_projection_keeps_attention_width(model_dir):
    model, _ = load_cached(model_dir("qwen3_next"))
    attn = model.layers[1].self_attn
    assert attn.q_proj.weight.shape[0] == 2 * attn.num_attention_heads * attn.head_dim  # query + gate
    shape = attention_shape(attn)
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim) == (4, 2, 16)
    assert attn.o_proj.weight.shape[1] == shape.n_heads * shape.head_dim


def test_pure_ssm_model_has_only_aux_layers(model_dir):
    model, _ = load_cached(model_dir("mamba2"))
    layout = discover(model)
    assert layout.attention_layers == () and layout.aux_layers == (0, 1) and layout.kv_shape is None


class _Proj(nn.Module):
    def __init__(self, out: int) -> None:
        super().__init__()
        self.weight = mx.zeros((out, 8))


class _AttnSpelledHF(nn.Module):
    """Hugging Face spelling of head counts, no head_dim attribute."""

    def __init__(self) -> None:
        super().__init__()
        self.num_attention_heads = 4
        self.num_key_value_heads = 2
        self.scale = 0.25
        self.rope = nn.RoPE(16)
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = _Proj(64), _Proj(32), _Proj(32), _Proj(8)


class _FusedAttention(nn.Module):
    """Attention under names discovery never knew: one fused projection, no RoPE, no head
    attributes; it stores K/V through its cache and attends through this module's
    ``scaled_dot_product_attention``. ``by_hand`` attends without that call instead."""

    def __init__(self, by_hand: bool = False) -> None:
        super().__init__()
        self.wqkv = nn.Linear(8, 4 * 4 + 2 * 2 * 4, bias=False)
        self.wo = nn.Linear(4 * 4, 8, bias=False)
        self.by_hand = by_hand

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        b, n, _ = x.shape
        q, k, v = mx.split(self.wqkv(x), [16, 24], axis=-1)
        q = q.reshape(b, n, 4, 4).transpose(0, 2, 1, 3)
        k, v = (t.reshape(b, n, 2, 4).transpose(0, 2, 1, 3) for t in (k, v))
        if cache is not None:
            k, v = cache.update_and_fetch(k, v)
        if self.by_hand:
            out = mx.fast.scaled_dot_product_attention(q, k, v, scale=0.5, mask=mask)
        else:
            out = scaled_dot_product_attention(q, k, v, cache=cache, scale=0.5, mask=mask)
        return self.wo(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _StateMixer(nn.Module):
    """A recurrent mixer with q/k/v/o projections and a cache: it keeps a state in it."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(8, 8, bias=False) for _ in range(4))

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        state = self.k_proj(x) * self.v_proj(x)
        if cache is not None:
            state = state + (cache[0] if cache[0] is not None else 0)
            cache[0] = state
        return self.o_proj(self.q_proj(x) * state)


class _Layer(nn.Module):
    def __init__(self, mixer: nn.Module, name: str) -> None:
        super().__init__()
        setattr(self, name, mixer)
        self.mlp = nn.Linear(8, 8)


class _Model(nn.Module):
    def __init__(self, layers: list[nn.Module]) -> None:
        super().__init__()
        self.layers = layers

    def make_cache(self) -> list:
        return [KVCache() for _ in self.layers]


def test_head_count_spellings_and_head_dim_from_k_proj():
    shape = attention_shape(_AttnSpelledHF())
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim) == (4, 2, 16)


def test_attention_is_what_stores_kv_through_its_cache():
    """Names and projections do not make attention; storing K/V through the cache does."""
    assert is_softmax_attention(_FusedAttention())
    assert not is_softmax_attention(_StateMixer())
    assert not is_softmax_attention(_AttnSpelledHF())  # projections, RoPE, heads, but no call
    assert find_attention(_Layer(_StateMixer(), "self_attn")) is None
    assert find_attention(_Layer(_FusedAttention(), "block_mixer")) == "block_mixer"
    probe = probe_attention(_FusedAttention())
    assert (probe.width, probe.kv_heads, probe.head_dim, probe.query_heads) == (8, 2, 4, 4) and probe.routed


def test_unnamed_attention_is_served_and_its_geometry_probed():
    layout = discover(_Model([_Layer(_FusedAttention(), "block_mixer") for _ in range(2)]))
    assert layout.attention_layers == (0, 1) and layout.attn_attr == ("block_mixer", "block_mixer")
    assert (layout.kv_shape.n_heads, layout.kv_shape.n_kv_heads, layout.kv_shape.head_dim) == (4, 2, 4)


def test_refusals_name_what_is_not_served():
    with pytest.raises(UnsupportedModel, match="cache entry 0 is a KV cache, but no module of layer 0"):
        discover(_Model([_Layer(_StateMixer(), "self_attn")]))


def test_attention_by_hand_is_served_but_not_routed():
    """A module that never makes its module's attention call cannot have it answered from the
    pool (a paged decode): it is served where its cache returns every position's K/V."""
    assert discover(_Model([_Layer(_FusedAttention(), "attn")])).routed
    by_hand = _FusedAttention(by_hand=True)
    by_hand.n_heads = 4  # no attention call to read the query heads from
    assert not discover(_Model([_Layer(by_hand, "attn")])).routed


def test_quantized_projections_give_float_kv_dtype(model_dir):
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir("phi3"))  # a private copy: quantized in place
    nn.quantize(model, group_size=32, bits=4)
    attn = model.layers[0].self_attn
    assert attn.qkv_proj.weight.dtype == mx.uint32
    assert compute_dtype(attn, mx.bfloat16) == mx.float32  # from the scales
    assert discover(model).kv_dtype == mx.float32


@pytest.mark.parametrize("arch, attr", [("phi3", "self_attn"), ("bailing_moe", "attention")])
def test_fused_qkv_projections_are_attention(model_dir, arch, attr):
    model, _ = load_cached(model_dir(arch))
    layout = discover(model)
    assert layout.attention_layers == (0, 1) and layout.attn_attr == (attr, attr)
    assert not hasattr(getattr(model.layers[0], attr), "k_proj")


def test_lfm2_attention_between_conv_layers(model_dir):
    model, _ = load_cached(model_dir("lfm2"))
    layout = discover(model)
    assert layout.attention_layers == (1, 3) and layout.aux_layers == (0, 2)
    assert layout.attn_attr == (None, "self_attn", None, "self_attn")
    assert not is_softmax_attention(model.layers[0].conv)  # a short-conv mixer with a cache


def test_nemotron_h_attention_without_rope(model_dir):
    """Mamba, attention, Mamba, MLP: three cache entries for four layers; no RoPE."""
    model, _ = load_cached(model_dir("nemotron_h"))
    layout = discover(model)
    assert layout.num_layers == 3 and layout.kv_index == (-1, 0, -1) and layout.aux_layers == (0, 2)
    assert layout.attn_attr == (None, "mixer", None, None)
    assert not hasattr(model.layers[1].mixer, "rope")
    assert not is_softmax_attention(model.layers[0].mixer)


def test_cross_layer_attention_takes_the_probed_layers_geometry(model_dir):
    """Hunyuan's attention returns (output, K/V projections); its second layer has no K/V
    projections (it reuses the first's), so it cannot be probed alone and is taken as the
    attention class probed in layer 0. Mamba v1 has recurrent state only."""
    model, _ = load_cached(model_dir("hunyuan"))
    second = model.layers[1].self_attn
    assert not hasattr(second, "k_proj") and probe_attention(second) is None
    assert probe_attention(model.layers[0].self_attn) is not None
    layout = discover(model)
    assert layout.attention_layers == (0, 1) and layout.attn_attr == ("self_attn", "self_attn")
    assert (layout.kv_shape.n_heads, layout.kv_shape.n_kv_heads, layout.kv_shape.head_dim) == (4, 2, 16)
    mamba, _ = load_cached(model_dir("mamba"))
    layout = discover(mamba)
    assert layout.attention_layers == () and layout.aux_layers == (0, 1) and layout.kv_shape is None


def test_nested_cache_lists_are_flattened(model_dir):
    """Falcon-H1: CacheList(Mamba state, KV cache) per layer, one flat entry per part."""
    from mlx_lm.models.cache import ArraysCache, CacheList

    model, _ = load_cached(model_dir("falcon_h1"))
    layout = discover(model)
    assert layout.num_layers == 4 and layout.kv_index == (-1, 0, -1, 1) and layout.aux_layers == (0, 2)
    assert layout.attn_attr == ("self_attn", "self_attn") and layout.groups.sizes == (2, 2)
    flat = layout.flatten(model.make_cache())
    assert [type(c).__name__ for c in flat] == ["ArraysCache", "KVCache"] * 2
    nested = layout.nest(flat)
    assert all(isinstance(c, CacheList) for c in nested) and nested[1][0] is flat[2] and nested[1][1] is flat[3]
    made = model.make_cache
    try:
        model.make_cache = lambda: [CacheList(ArraysCache(2), CacheList(KVCache()))] * 2
        with pytest.raises(UnsupportedModel, match="cache entry 0 is a CacheList that is empty or holds another"):
            discover(model)
        model.make_cache = lambda: [CacheList(KVCache(), KVCache())] * 2
        with pytest.raises(UnsupportedModel, match="cache entry 0 is a CacheList of several KV caches"):
            discover(model)
    finally:
        model.make_cache = made


def test_sliding_window_layers_are_served_with_their_windows(model_dir):
    model, _ = load_cached(model_dir("gemma3_text"))
    layout = discover(model)  # RotatingKVCache layers: full K/V in the pool, masked to their window
    assert layout.windowed and any(w is not None for w in layout.windows)


@pytest.mark.parametrize("arch", ["llama", "gemma3_text"])
def test_mask_probes_run_once_per_kind_of_attention_module(model_dir, monkeypatch, arch):
    """The decode-mask probes run a forward each (seconds a layer for a large bf16 model on a
    CPU): once for layers whose attention modules are alike (llama), again for each module that
    differs in a plain attribute (gemma3 records its layer index, which its call may read)."""
    from runtime.worker.model import discovery

    calls = []
    probe = discovery.query_mask_rank
    monkeypatch.setattr(discovery, "query_mask_rank", lambda module, *a: calls.append(module) or probe(module, *a))
    model, _ = load_cached(model_dir(arch))
    layout = discover(model)
    layers = len(layout.attention_layers)
    assert layers > 1
    assert len(calls) == (1 if arch == "llama" else layers)
    assert len({discovery.behaviour_key(m) for m in calls}) == len(calls)
