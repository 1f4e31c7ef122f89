"""The output head over a batch's first rows only (``OutputHead.first_rows``, the fused step's)."""

from __future__ import annotations

import mlx.core as mx
import pytest
from mlx_lm import load

from runtime.worker.model.output_head import OutputHead


@pytest.mark.parametrize("arch", ["llama", "qwen3"], ids=["own-head", "tied-embeddings"])
def test_first_rows_computes_those_rows_only_and_the_same_logits(arch, model_dir):
    model, _ = load(str(model_dir(arch)))
    head = OutputHead(model)
    assert head.found
    tokens = mx.array([[5], [17], [42], [99], [7]], dtype=mx.int32)  # five rows of one token
    full = model(tokens)
    with head.first_rows(2):
        first = model(tokens)
        with pytest.raises(RuntimeError, match="does not nest"), head.first_rows(1):
            pass
    assert first.shape == (2, 1, full.shape[-1])
    assert mx.array_equal(first, full[:2]).item()
    assert model(tokens).shape == full.shape  # restored on exit
    assert set(dict(model.parameters()).keys()) == set(dict(load(str(model_dir(arch)))[0].parameters()).keys())


def test_a_model_without_a_known_head_is_left_alone():
    import mlx.nn as nn

    class Plain(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.output = nn.Linear(4, 3)

        def __call__(self, x: mx.array) -> mx.array:
            return self.output(x)

    model = Plain()
    head = OutputHead(model)
    assert not head.found
    with head.first_rows(1):
        assert model(mx.zeros((3, 4))).shape == (3, 3)
