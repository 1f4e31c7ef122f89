"""InternLM 2 / 3's dynamic-NTK RoPE served as a fixed base: bit-identical to mlx-lm's modules
below ``max_position_embeddings``, per row for batched decode's offsets, and the context capped
at that limit."""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import internlm3, rope_utils
from model_factory import make_model

from runtime.config import parse_config
from runtime.worker.model.fixed_ntk_rope import FixedBaseRoPE, fix_dynamic_ntk_rope

LIMIT = 64
DIMS = 16
HEADS = 4
LENGTH = 3


class _Holder(nn.Module):
    """A module holding one RoPE, as an attention layer does."""

    def __init__(self, rope: nn.Module) -> None:
        super().__init__()
        self.rope = rope


def _references() -> dict[str, nn.Module]:
    return {
        "rope_utils": rope_utils.DynamicNTKScalingRoPE(DIMS, LIMIT, traditional=False, base=10000.0, factor=2.0),
        "internlm3": internlm3.DynamicNTKScalingRoPE(DIMS, LIMIT, traditional=False, base=10000.0, scale=0.5),
    }


def _swapped(reference: nn.Module) -> nn.Module:
    holder = _Holder(reference)
    assert fix_dynamic_ntk_rope(holder) == LIMIT
    assert isinstance(holder.rope, FixedBaseRoPE)
    return holder.rope


def _queries(rows: int) -> mx.array:
    return mx.random.normal((rows, HEADS, LENGTH, DIMS), key=mx.random.key(3))


# internlm3's module compares heads + offset (x.shape[1]) with the limit: stay below it there too.
OFFSETS = (0, 1, 17, LIMIT - max(HEADS, LENGTH))


@pytest.mark.parametrize("kind", ["rope_utils", "internlm3"])
def test_one_row_is_bit_identical_below_the_limit(kind):
    reference = _references()[kind]
    fixed = _swapped(_references()[kind])
    x = _queries(1)
    for offset in OFFSETS:
        assert mx.array_equal(fixed(x, offset=offset), reference(x, offset=offset)).item(), offset


@pytest.mark.parametrize("kind", ["rope_utils", "internlm3"])
def test_rows_at_different_positions_match_each_row_alone(kind):
    reference = _references()[kind]
    fixed = _swapped(_references()[kind])
    x = _queries(len(OFFSETS))
    out = fixed(x, offset=mx.array(OFFSETS))
    for row, offset in enumerate(OFFSETS):
        assert mx.array_equal(out[row:row + 1], reference(x[row:row + 1], offset=offset)).item(), offset


def test_internlm3_module_limit_leaves_room_for_its_head_count():
    """internlm3's own module measures its length as x.shape[1] (the head count) plus the offset,
    so its base changes once heads + offset pass the limit: the fixed base stops short of it."""
    holder = _Holder(_references()["internlm3"])
    holder.n_heads, holder.n_kv_heads = 8, 2
    assert fix_dynamic_ntk_rope(holder) == LIMIT - 8


def test_other_modules_are_left_alone():
    holder = _Holder(nn.RoPE(DIMS))
    assert fix_dynamic_ntk_rope(holder) is None
    assert type(holder.rope) is nn.RoPE


def _load(folder, **scheduler):
    from runtime.worker.loader import load

    return load(parse_config({"model": {"path": str(folder)}, "scheduler": scheduler}))


@pytest.mark.parametrize("arch", ["internlm2", "internlm3"])
def test_the_loader_swaps_and_caps_the_context(arch, tmp_path):
    folder = make_model(arch, tmp_path / arch, check=False, max_position_embeddings=LIMIT)
    loaded = _load(folder)
    ropes = [m for _, m in loaded.model.named_modules() if "rope" in type(m).__name__.lower()]
    assert ropes and all(isinstance(m, FixedBaseRoPE) for m in ropes)
    limit = LIMIT  # both take rope_utils' module (initialize_rope); internlm3's own class is unused
    assert {m.max_position_embeddings for m in ropes} == {limit}
    assert loaded.max_context <= limit
    assert _load(folder, max_context=limit).max_context == limit
    with pytest.raises(ValueError, match=f"dynamic-NTK RoPE limit of {limit}"):
        _load(folder, max_context=limit + 1)
