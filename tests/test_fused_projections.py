"""Fused q/k/v and gate/up projections: bit-identical to the separate ones, token-exact served."""

from __future__ import annotations

import gc
import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from harness import InProcessService
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from model_factory import reference_greedy

from runtime.config import ConfigError, parse_config
from runtime.worker.model import fused_projections
from runtime.worker.model.discovery import model_layers
from runtime.worker.model.fused_projections import (
    FusedPart,
    fuse_projections,
    fusion_wanted,
)


def _projections(model: nn.Module, x: mx.array) -> list[mx.array]:
    out = []
    for layer in model_layers(model):
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            out += [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "gate_proj"):
            out += [mlp.gate_proj(x), mlp.up_proj(x)]
    mx.eval(out)
    return out


def _decode_logits(model: nn.Module, prompt: list[int]) -> mx.array:
    """mlx-lm's own prefill, then one one-token decode step."""
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    logits = model(mx.array([[prompt[-1]]]), cache=cache)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("arch,quantize", [("llama", False), ("qwen3", False), ("llama", True), ("qwen3_next", False)])
def test_fused_projections_are_bit_identical(model_dir, arch, quantize):
    model, _ = load_model(model_dir(arch))
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    hidden = model.args.hidden_size
    one = mx.random.normal((1, 1, hidden), key=mx.random.key(1))
    many = mx.random.normal((2, 5, hidden), key=mx.random.key(2))
    prompt = [5, 17, 33, 2, 90, 41, 7]
    want_one, want_many = _projections(model, one), _projections(model, many)
    want_logits = _decode_logits(model, prompt)

    groups = fuse_projections(model)
    layers = model_layers(model)
    assert groups >= len(layers)  # at least one group per layer
    assert fuse_projections(model) == 0  # idempotent: fused parts are not plain linears

    products = []
    product = fused_projections._Stacked._product
    fused_projections._Stacked._product = lambda self, x: products.append(x) or product(self, x)
    try:
        got_one = _projections(model, one)
        calls = len(products)
        got_many = _projections(model, many)
        got_logits = _decode_logits(model, prompt)
    finally:
        fused_projections._Stacked._product = product
    assert calls == groups  # one product per group for a one-token input, not one per projection
    assert len(products) > calls  # the decode step took the fused path too
    assert len(got_one) == len(want_one) and len(got_many) == len(want_many)
    for a, b in zip(want_one + want_many, got_one + got_many):
        assert a.shape == b.shape and bool(mx.array_equal(a, b))
    assert bool(mx.array_equal(want_logits, got_logits))


def test_fusing_keeps_one_copy_of_the_weights(model_dir):
    model, _ = load_model(model_dir("llama"))
    mx.eval(model.parameters())
    attn = model_layers(model)[0].self_attn
    projection_bytes = sum(m.weight.nbytes for m in (attn.q_proj, attn.k_proj, attn.v_proj)) * len(model_layers(model))
    gc.collect()
    before = mx.get_active_memory()
    fuse_projections(model)
    gc.collect()
    after = mx.get_active_memory()
    assert isinstance(attn.q_proj, FusedPart)
    assert after - before < projection_bytes // 4  # the separate weights were freed, not kept beside the stack


def test_projections_with_a_bias_are_left_alone():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16, bias=True) for _ in range(3))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)

    attn, mlp = Attention(), MLP()
    assert fuse_projections(attn) == 0 and isinstance(attn.q_proj, nn.Linear)
    assert fuse_projections(mlp) == 1 and isinstance(mlp.up_proj, FusedPart)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_next"])
def test_fused_service_is_token_exact(model_dir, arch):
    folder = model_dir(arch)
    rng = random.Random(4)
    shared = [rng.randrange(3, 250) for _ in range(30)]
    kwargs = {"aux_slots": 64} if arch == "qwen3_next" else {}
    svc = InProcessService(folder, fuse=True, **kwargs)
    assert any(isinstance(m, FusedPart) for _, m in svc.engine.model.named_modules())
    alone = svc.request("alone", shared + [4, 5], 14)  # one row: every decode step one token
    svc.run({0: [alone]})
    reqs = [svc.request(f"r{i}", shared + [rng.randrange(3, 250) for _ in range(1 + i)], 10) for i in range(4)]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    for r in [alone] + reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_fuse_projections_setting():
    assert parse_config({"model": {"path": "/m"}}).worker.fuse_projections == "auto"
    with pytest.raises(ConfigError, match="fuse_projections"):
        parse_config({"model": {"path": "/m"}, "worker": {"fuse_projections": "yes"}})
    assert fusion_wanted("auto", on_gpu=True, compiled_step=True)
    assert not fusion_wanted("auto", on_gpu=False, compiled_step=True)
    assert not fusion_wanted("auto", on_gpu=True, compiled_step=False)  # hybrids, compile_decode off
    assert fusion_wanted("on", on_gpu=False, compiled_step=False)
    assert not fusion_wanted("off", on_gpu=True, compiled_step=True)


def test_the_loader_fuses_when_configured(model_dir):
    from runtime.worker.loader import load

    folder = model_dir("llama")
    loaded = {}
    for setting in ("off", "on"):
        config = parse_config({"model": {"path": str(folder)}, "worker": {"fuse_projections": setting}})
        loaded[setting] = load(config)
    layers = len(model_layers(loaded["on"].model))
    assert loaded["off"].fused_groups == 0 and loaded["on"].fused_groups == 2 * layers  # q/k/v and gate/up
    assert isinstance(model_layers(loaded["on"].model)[0].mlp.gate_proj, FusedPart)
    prompt = [9, 8, 7, 6, 5]
    assert bool(mx.array_equal(_decode_logits(loaded["off"].model, prompt), _decode_logits(loaded["on"].model, prompt)))
