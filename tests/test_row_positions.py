"""GPTBigCode's learned positions looked up per row (``worker/model/row_positions.py``).

Its token-exactness against mlx-lm runs with every family's (``test_more_families_exact``,
``test_gemma2_exact``, ``test_fused_families``); here: what the loader swaps, and the context
it caps at the position table's length.
"""

from __future__ import annotations

import mlx.core as mx
import pytest
from factory_shapes import MAX_POS
from harness import InProcessService
from mlx_lm.models import gpt_bigcode

from runtime.worker.model.row_positions import PerRowPositions, serve_row_positions


def test_the_forward_takes_a_position_per_row(model_dir):
    from mlx_lm.utils import load_model

    model, _ = load_model(model_dir("gpt_bigcode"))
    inner = model.transformer
    assert type(inner) is gpt_bigcode.GPTBigCodeModel
    assert serve_row_positions(model) == MAX_POS and type(inner) is PerRowPositions
    assert serve_row_positions(model) is None  # swapped once

    class Offset:  # what a batched decode's cache offers: one position per row
        def __init__(self, offset):
            self.offset = offset

        def update_and_fetch(self, k, v):
            return k, v

    tokens = mx.array([[11], [12]])
    rows = [inner(tokens[i : i + 1], cache=[Offset(p) for _ in inner.h]) for i, p in enumerate((5, 9))]
    both = inner(tokens, cache=[Offset(mx.array([5, 9])) for _ in inner.h])
    assert mx.array_equal(both, mx.concatenate(rows)).item()


def test_the_context_stops_at_the_position_table(model_dir):
    with pytest.raises(ValueError, match=f"learned-position table of {MAX_POS} positions"):
        InProcessService(model_dir("gpt_bigcode"), max_context=MAX_POS + 1)
    assert InProcessService(model_dir("gpt_bigcode"), max_context=MAX_POS).engine.max_context <= MAX_POS
