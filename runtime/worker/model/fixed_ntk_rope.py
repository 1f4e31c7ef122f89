"""Dynamic-NTK RoPE (InternLM 2 / 3) as a fixed-base RoPE, valid within the trained context.

mlx-lm's dynamic-NTK modules (``rope_utils.DynamicNTKScalingRoPE``, ``internlm3``'s own) pick
their base by comparing ``length + offset`` with ``max_position_embeddings`` on the host, so
they fail on batched decode's per-row ``mx.array`` offsets. Below that limit both use one
constant base; ``FixedBaseRoPE`` rotates with that base, computed by mlx-lm's own expression
(the same float bits), and takes a per-row offset. The loader caps the context at the limit
(``rope_limit``), so no position past it is ever served.
"""

from __future__ import annotations

import mlx.nn as nn
from mlx_lm.models import internlm3, rope_utils


class FixedBaseRoPE(nn.RoPE):
    """MLX's ``nn.RoPE`` with one base and scale, and the context it is exact for: positions below
    ``max_position_embeddings``."""

    def __init__(self, dims: int, traditional: bool, base: float, scale: float,
                 max_position_embeddings: int) -> None:
        super().__init__(dims, traditional=traditional, base=base, scale=scale)
        self.max_position_embeddings = max_position_embeddings


def _fixed(rope: nn.Module, owner: nn.Module) -> FixedBaseRoPE | None:
    """The fixed-base equivalent of a dynamic-NTK module held by ``owner``, or None for any other module."""
    if isinstance(rope, rope_utils.DynamicNTKScalingRoPE):
        # rope_utils' formula at seq_len = max_position_embeddings, written as mlx-lm writes it.
        seq_len = rope.max_position_embeddings
        base = rope.base * (
            (rope.factor * seq_len / rope.max_position_embeddings) - (rope.factor - 1)
        ) ** (rope.dims / (rope.dims - 2))
        return FixedBaseRoPE(rope.dims, rope.traditional, base, 1.0, rope.max_position_embeddings)
    if isinstance(rope, internlm3.DynamicNTKScalingRoPE):
        # This class measures its length as x.shape[1], the head count (queries or keys), plus
        # the offset: its base changes once heads + offset pass the limit, so the fixed base is
        # exact only below the limit less the larger head count.
        heads = max(getattr(owner, "n_heads", 0), getattr(owner, "n_kv_heads", 0))
        return FixedBaseRoPE(rope.dims, rope.traditional, rope.original_base, rope.scale,
                             rope.max_position_embeddings - heads)
    return None


def fix_dynamic_ntk_rope(model: nn.Module) -> int | None:
    """Swap every dynamic-NTK RoPE in ``model`` for its fixed-base equivalent, in place.

    Returns the smallest ``max_position_embeddings`` of the swapped modules (the context the
    runtime must not exceed), or None when the model has none.
    """
    limit: int | None = None
    for _, module in model.named_modules():
        for name, child in list(module.children().items()):
            fixed = _fixed(child, module) if isinstance(child, nn.Module) else None
            if fixed is None:
                continue
            setattr(module, name, fixed)
            limit = fixed.max_position_embeddings if limit is None else min(limit, fixed.max_position_embeddings)
    return limit
