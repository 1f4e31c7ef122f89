"""Float32 projections over transposed weights (``runtime/worker/model/transposed_linear.py``):
the same bits as ``nn.Linear``, applied where the worker's BLAS is the bundled reference one,
and the service stays token-exact with mlx-lm's greedy output with them."""

from __future__ import annotations

import random

import mlx.core as mx
import mlx.nn as nn
import pytest
from harness import InProcessService
from model_factory import reference_greedy

import runtime.worker.loader as loader
from runtime.worker.model.fused_projections import (
    FusedPart,
    fuse_projections,
    probe_rows,
    transpose_stacked,
)
from runtime.worker.model.transposed_linear import TransposedLinear, transpose_linears


@pytest.mark.parametrize(("out", "inp"), [(256, 256), (128, 256), (1024, 256), (256, 1024), (1000, 64), (24, 40)])
@pytest.mark.parametrize("rows", [1, 3, 127])
def test_the_transposed_product_has_the_linear_layers_bits(out, inp, rows):
    linear = nn.Linear(inp, out, bias=False)
    t = TransposedLinear(mx.contiguous(linear.weight.T))
    for x in (mx.random.normal((rows, inp), key=mx.random.key(rows)),
              mx.random.normal((rows, 1, inp), key=mx.random.key(rows + 1))):  # a decode step's (rows, 1, width)
        assert mx.array_equal(t(x), linear(x)).item()
    assert t.weight.shape == (out, inp) and mx.array_equal(t.weight, linear.weight).item()


def test_only_bias_free_float32_linears_are_converted():
    class Block(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.plain = nn.Linear(8, 8, bias=False)
            self.biased = nn.Linear(8, 8, bias=True)  # addmm adds the bias in another order
            self.half = nn.Linear(8, 8, bias=False)
            self.half.set_dtype(mx.bfloat16)  # MLX's own kernels: nothing to gain
            self.quantized = nn.QuantizedLinear(64, 64, bias=False)
            self.experts = [nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=True)]

    block = Block()
    before = block.plain.weight
    assert transpose_linears(block) == 2
    assert isinstance(block.plain, TransposedLinear) and mx.array_equal(block.plain.weight, before).item()
    assert type(block.biased) is nn.Linear and type(block.half) is nn.Linear
    assert isinstance(block.quantized, nn.QuantizedLinear)
    assert isinstance(block.experts[0], TransposedLinear) and type(block.experts[1]) is nn.Linear
    assert transpose_linears(block) == 0  # idempotent


def test_a_fused_group_over_a_transposed_stack_keeps_every_path_exact():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(64, n, bias=False) for n in (64, 32, 32))

    attn = Attention()
    reference = [attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]
    assert fuse_projections(attn) == 1 and transpose_stacked(attn) == 1
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    assert all(isinstance(p, FusedPart) and isinstance(p.linear, TransposedLinear) for p in parts)
    assert probe_rows(attn, [1, 2, 4, 8]) == {1: True, 2: True, 4: True, 8: True}
    for x in (mx.random.normal((1, 64)), mx.random.normal((4, 1, 64)), mx.random.normal((2, 9, 64))):
        for part, w in zip(parts, reference):
            assert mx.array_equal(part(x), x @ w.T).item()  # stacked (one token a row) and separate paths


@pytest.mark.parametrize("arch", ["llama", "qwen3_next", "deepseek_v2", "gemma3_text", "mamba2"])
def test_a_service_on_transposed_weights_is_token_exact(model_dir, monkeypatch, arch):
    monkeypatch.setattr(loader, "reference_blas", lambda: True)  # as on the bundled BLAS, whatever this host has
    folder = model_dir(arch)
    kwargs = {"aux_slots": 64} if arch in ("qwen3_next", "mamba2") else {}
    svc = InProcessService(folder, **kwargs)
    assert any(isinstance(m, TransposedLinear) for _, m in svc.engine.model.named_modules())
    rng = random.Random(7)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    reqs = [svc.request(f"r{i}", shared + [rng.randrange(3, 250) for _ in range(1 + 2 * i)], 12) for i in range(4)]
    svc.run({0: reqs[:1], 2: reqs[1:]})  # one alone, then three batched on a cached prefix
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
