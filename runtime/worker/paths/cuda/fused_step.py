"""One forward for a step's prefill chunks and its decode rows (the CUDA kernel path).

A step that carries prefill otherwise runs each batch of its chunks as a forward of its own
(a host sync between batches: a later batch's pool write must not find the earlier one's
graph still holding the pools), then the decode forward: on a GPU, where a step's host time
is MLX encoding its kernels, that is two or more forwards' worth of encoding for one step.
Here every prefill token is a row of one token beside the decode rows: the projections,
norms and MLP see one batch, RoPE takes each row's own position, and only the attention is
split, inside each layer: the decode rows through the paged kernel (appending to the decode
tail), each prefill batch through MLX's attention over its gathered keys, as the separate
prefill forward would run it. A layer writes every prefill row's K/V to the pool before any
row attends, so a batch reads what an earlier chunk of its request wrote in this step.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.worker.model.discovery import CacheLayout
from runtime.worker.model.output_head import OutputHead
from runtime.worker.paths.pool_cache import CacheStandIn, ForwardBatch, PoolLayerCache
from runtime.worker.pools.kv_pool import KVPool


@dataclass
class PrefillPart:
    """One batch of prefill chunks (``rows`` x ``length``, padded) and its rows ``lo..hi`` of
    the fused batch, prefill token t of row r at ``lo + r * length + t``."""

    batch: ForwardBatch
    rows: int
    length: int
    lo: int

    @property
    def hi(self) -> int:
        return self.lo + self.rows * self.length


@dataclass
class FusedBatch:
    """The decode rows (``decode``, the first ``decode_rows`` rows, padding rows included)
    and the prefill parts after them; ``positions``: every row's position, (rows,) int32."""

    decode: ForwardBatch
    decode_rows: int
    prefills: list[PrefillPart]
    positions: mx.array


class FusedLayerCache(CacheStandIn):
    """Stands in for mlx-lm's KVCache in one attention layer of a fused step's forward."""

    paged = True  # the attention dispatcher sends the layer's attention call to paged_attend

    def __init__(self, pool: KVPool, kv_layer: int, step: FusedBatch) -> None:
        self.pool, self.kv_layer, self.step = pool, kv_layer, step
        self.new: tuple[mx.array, mx.array] | None = None  # this step's K/V, every row
        self.decode = PoolLayerCache(pool, kv_layer, step.decode)  # the decode rows' attention, as unfused

    @property
    def offset(self) -> mx.array:
        return self.step.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.new = (keys, values)
        for part in self.step.prefills:  # all before any attention: see the module's docstring
            assert part.batch.write_slots is not None
            self.pool.write(self.kv_layer, part.batch.write_slots, keys[part.lo:part.hi, :, 0, :],
                            values[part.lo:part.hi, :, 0, :])
        return keys, values

    def paged_attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        assert self.new is not None and sinks is None, "a model with attention sinks is not fused"
        keys, values = self.new
        r = self.step.decode_rows
        self.decode.new = (keys[:r], values[:r])
        outs = [self.decode.paged_attend(queries[:r], scale)]
        outs += [self._prefill(part, queries[part.lo:part.hi], keys[part.lo:part.hi], values[part.lo:part.hi], scale)
                 for part in self.step.prefills]
        return mx.concatenate(outs, axis=0)

    def _prefill(self, part: PrefillPart, queries: mx.array, keys: mx.array, values: mx.array,
                 scale: float) -> mx.array:
        """The batch's causal attention, shaped back to rows of one token."""
        rows, n = part.rows, part.length
        _, n_q, _, head_dim = queries.shape

        def batched(x: mx.array) -> mx.array:  # (rows * n, heads, 1, d) -> (rows, heads, n, d)
            return x.reshape(rows, n, x.shape[1], x.shape[3]).transpose(0, 2, 1, 3)

        if part.batch.gather_index is None:  # the chunks are their rows' whole sequences
            k, v = batched(keys), batched(values)
        else:
            k, v = self.pool.gather(self.kv_layer, part.batch.gather_index)
        mask = part.batch.mask if part.batch.mask is not None else "causal" if n > 1 else None
        out = mx.fast.scaled_dot_product_attention(batched(queries), k, v, scale=scale, mask=mask)
        return out.transpose(0, 2, 1, 3).reshape(rows * n, n_q, 1, head_dim)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        return None  # rows of one token: the kernel takes each decode row's length, the parts their own masks


def fused_logits(model: nn.Module, head: OutputHead, layout: CacheLayout, pool: KVPool, decode: ForwardBatch,
                 decode_inputs: mx.array, prefills: list[tuple[ForwardBatch, list[list[int]], int]]) -> mx.array:
    """The logits of the decode rows (``decode_inputs``, padding rows included, addressed by
    ``decode``) from one forward that also runs every prefill batch ``(batch, tokens, start)``
    (its (rows, length) tokens from position ``start``); lazy. ``head``: the model's, which
    computes the decode rows only (the prefill rows' logits are never read)."""
    rows = decode_inputs.shape[0]
    offset = decode.offset
    positions = [offset if isinstance(offset, mx.array) else mx.full((rows,), offset, mx.int32)]
    parts, tokens, lo = [], [decode_inputs], rows
    for batch, part_tokens, start in prefills:
        part = PrefillPart(batch, len(part_tokens), len(part_tokens[0]), lo)
        parts.append(part)
        lo = part.hi
        tokens.append(mx.array([t for row in part_tokens for t in row], dtype=mx.int32))
        positions.append(mx.array(np.tile(np.arange(start, start + part.length, dtype=np.int32), part.rows)))
    step = FusedBatch(decode, rows, parts, mx.concatenate(positions))
    caches = layout.nest([FusedLayerCache(pool, kv_i, step) for kv_i in layout.kv_index])
    with head.first_rows(rows):
        logits = model(mx.concatenate(tokens)[:, None], cache=caches)
    return logits[:rows, -1, :]
