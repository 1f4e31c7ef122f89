"""Quantized products over (rows, width): the same bits, one matrix product per step."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten

from runtime.worker.model.flat_quantized import (
    FlatQuantizedEmbedding,
    FlatQuantizedLinear,
    flatten_quantized,
)


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(100, 64)
        self.proj = nn.Linear(64, 96, bias=True)
        self.head = nn.Linear(96, 64, bias=False)
        self.norm = nn.RMSNorm(64)


def _quantized() -> nn.Module:
    model = _Tiny()
    nn.quantize(model, group_size=32, bits=4)
    mx.eval(model.parameters())
    return model


def test_every_quantized_layer_gets_the_flat_class_and_keeps_its_parameters():
    model = _quantized()
    before = {name: value for name, value in tree_flatten(model.parameters())}
    assert flatten_quantized(model) == 3
    assert type(model.embed) is FlatQuantizedEmbedding and type(model.proj) is FlatQuantizedLinear
    assert type(model.head) is FlatQuantizedLinear and type(model.norm) is nn.RMSNorm
    after = dict(tree_flatten(model.parameters()))
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert flatten_quantized(model) == 0  # already flat: nothing to do


@pytest.mark.parametrize("shape", [(1, 1, 64), (5, 1, 64), (64, 1, 64), (3, 7, 64), (9, 64), (64,)])
def test_the_flat_products_give_the_same_bits(shape):
    plain, flat = _quantized(), _quantized()
    flat.update(plain.parameters())
    flatten_quantized(flat)
    x = mx.random.normal(shape, key=mx.random.key(len(shape))).astype(mx.bfloat16)
    assert mx.array_equal(flat.proj(x), plain.proj(x))  # with a bias
    y = plain.proj(x)
    assert mx.array_equal(flat.head(y), plain.head(y))
    assert mx.array_equal(flat.embed.as_linear(x), plain.embed.as_linear(x))  # a tied LM head
    ids = mx.array([[3, 4], [5, 6]])
    assert mx.array_equal(flat.embed(ids), plain.embed(ids))


def test_a_decode_step_runs_one_matrix_product_per_projection(monkeypatch):
    model = _quantized()
    flatten_quantized(model)
    ranks = []

    def recording(self, x):  # what the quantized product is called on
        ranks.append(x.shape)
        return mx.zeros((*x.shape[:-1], self["weight"].shape[0]))

    monkeypatch.setattr(nn.QuantizedLinear, "__call__", recording)
    out = model.proj(mx.zeros((64, 1, 64)))
    assert ranks == [(64, 64)] and out.shape == (64, 1, 96)  # 64 rows, not 64 batches of one row
