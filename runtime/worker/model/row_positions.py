"""GPTBigCode's learned positions for rows at different positions (StarCoder v1, SantaCoder).

mlx-lm's ``GPTBigCodeModel`` looks its position embeddings up at
``np.arange(cache[0].offset, cache[0].offset + L)``: one host number for the whole batch, so
batched decode's per-row ``mx.array`` offsets fail there. ``PerRowPositions`` is the same
forward with the positions built on the device, ``offset[:, None] + arange(L)`` for per-row
offsets (the same rows of the same table: the same bits). The table has ``n_positions`` rows,
so the loader caps the context there (``serve_row_positions``' limit).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import gpt_bigcode
from mlx_lm.models.base import create_attention_mask


class PerRowPositions(gpt_bigcode.GPTBigCodeModel):
    """``GPTBigCodeModel`` whose cache offset may be one position per row."""

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        _, length = inputs.shape
        hidden_states = self.wte(inputs)
        if cache is None:
            cache = [None] * len(self.h)
            position_ids = mx.arange(length)
        else:
            offset = cache[0].offset
            if isinstance(offset, mx.array) and offset.ndim == 1:
                position_ids = offset[:, None] + mx.arange(length)
            else:
                position_ids = mx.arange(length) + offset
        mask = create_attention_mask(hidden_states, cache[0])
        hidden_states = hidden_states + self.wpe(position_ids)
        for layer, c in zip(self.h, cache):
            hidden_states = layer(hidden_states, mask, cache=c)
        return self.ln_f(hidden_states)


def serve_row_positions(model: nn.Module) -> int | None:
    """Give every ``GPTBigCodeModel`` in ``model`` the per-row forward, in place; the smallest
    position table's length (the context the runtime must not exceed), or None when it has none."""
    limit: int | None = None
    for _, module in model.named_modules():
        if type(module) is gpt_bigcode.GPTBigCodeModel:
            module.__class__ = PerRowPositions
            rows = int(module.args.n_positions)
            limit = rows if limit is None else min(limit, rows)
    return limit
