"""Llama 4 within one attention chunk (``worker/model/chunked_attention.py``).

Its token-exactness against mlx-lm runs with every family's (``test_more_families_exact``,
``test_gemma2_exact``, ``test_fused_families``); here: what the loader swaps, that the NoPE
temperature per row is each row's own, and the context capped at the chunk size.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from factory_shapes import MAX_POS
from harness import InProcessService
from mlx_lm.models import llama4
from mlx_lm.models.cache import KVCache

from runtime.worker.model.chunked_attention import (
    PerRowTemperature,
    WithinChunk,
    WithinChunkCaches,
    serve_within_chunk,
)


def test_the_swaps_and_the_limit(model_dir):
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir("llama4"))
    assert type(model.make_cache()[0]).__name__ == "ChunkedKVCache"
    assert serve_within_chunk(model) == MAX_POS
    assert type(model) is WithinChunkCaches and type(model.language_model.model) is WithinChunk
    assert {type(layer.self_attn) for layer in model.layers} == {PerRowTemperature}
    assert all(type(c) is KVCache for c in model.make_cache())
    assert serve_within_chunk(model) is None  # swapped once


def test_the_nope_temperature_takes_a_position_per_row(model_dir):
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir("llama4"))
    serve_within_chunk(model)
    nope = model.layers[3].self_attn  # every fourth layer: no RoPE, temperature tuning
    assert not nope.use_rope and nope.attn_temperature_tuning

    class Offset:
        def __init__(self, offset):
            self.offset = offset

        def update_and_fetch(self, k, v):
            return k, v

    x = mx.random.normal((2, 3, model.args.text_config.hidden_size), key=mx.random.key(0))
    rows = [nope(x[i : i + 1], cache=Offset(p)) for i, p in enumerate((5, 700))]
    both = nope(x, cache=Offset(mx.array([5, 700])))
    assert mx.array_equal(both, mx.concatenate(rows)).item()
    plain = llama4.Attention(model.args.text_config, 3)
    plain.update(nope.parameters())
    assert mx.array_equal(plain(x[1:], cache=Offset(700)), rows[1]).item()  # mlx-lm's own, at one offset


def test_the_context_stops_at_the_chunk(model_dir):
    with pytest.raises(ValueError, match=f"attention chunk of {MAX_POS} positions"):
        InProcessService(model_dir("llama4"), max_context=MAX_POS + 1)
