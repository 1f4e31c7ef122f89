"""Model discovery (SPEC section 1): attention vs auxiliary layers, shapes, dtypes, refusals."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from model_factory import load_cached

from runtime.worker.discovery import (
    attention_shape,
    discover,
    find_attention,
    is_softmax_attention,
    kv_dtype,
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


class _ProjectionsOnly(nn.Module):
    """A linear mixer that merely has q/k/v/o projections."""

    def __init__(self) -> None:
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = _Proj(64), _Proj(32), _Proj(32), _Proj(8)


class _Layer(nn.Module):
    def __init__(self, mixer: nn.Module, name: str) -> None:
        super().__init__()
        setattr(self, name, mixer)


def test_head_count_spellings_and_head_dim_from_k_proj():
    shape = attention_shape(_AttnSpelledHF())
    assert (shape.n_heads, shape.n_kv_heads, shape.head_dim) == (4, 2, 16)


def test_projection_only_mixer_is_not_attention():
    assert is_softmax_attention(_AttnSpelledHF())
    assert not is_softmax_attention(_ProjectionsOnly())
    assert find_attention(_Layer(_ProjectionsOnly(), "self_attn")) is None
    assert find_attention(_Layer(_AttnSpelledHF(), "attention")) == "attention"


def test_quantized_projections_give_float_kv_dtype():
    linear = nn.Linear(64, 32, bias=False)
    quant = nn.QuantizedLinear.from_linear(linear, group_size=32, bits=4)
    holder = _AttnSpelledHF()
    holder.k_proj = quant
    assert quant.weight.dtype == mx.uint32
    assert kv_dtype(holder, mx.bfloat16) == mx.float32  # from the scales


def test_sliding_window_layers_are_served_with_their_windows(model_dir):
    model, _ = load_cached(model_dir("gemma3_text"))
    layout = discover(model)  # RotatingKVCache layers: full K/V in the pool, masked to their window
    assert layout.windowed and any(w is not None for w in layout.windows)
