"""Llama 4 served within one attention chunk (``attention_chunk_size``: 8,192 in its checkpoints).

mlx-lm's Llama 4 attends within aligned chunks on three layers of four (``ChunkedKVCache``),
builds those layers' masks from the first cache's host offset and start, and scales the NoPE
layers' queries by a temperature from ``mx.arange(offset + 1, offset + L + 1)``: one host number
for the whole batch, where batched decode gives each row its own position. Below the chunk size
a chunk mask is the causal mask and a chunked cache keeps every position, so there the model is
plain causal attention on every layer, and that is what the runtime serves:

* ``WithinChunk``: the text model's forward with one causal mask for every layer, from the
  runtime's cache (as every other model's);
* ``PerRowTemperature``: the attention with its NoPE temperature computed per row (the same
  float operations on the same positions: the same bits);
* ``WithinChunkCaches``: the wrapper's ``make_cache`` gives plain KV caches.

The loader caps the context at the chunk size (``serve_within_chunk``' limit), so no position
past it is served.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models import llama4
from mlx_lm.models.base import create_attention_mask, scaled_dot_product_attention
from mlx_lm.models.cache import KVCache


class WithinChunk(llama4.LlamaModel):
    """Llama 4's text model with the causal mask on every layer (exact below the chunk size)."""

    def __call__(self, inputs: mx.array, cache=None) -> mx.array:
        h = self.embed_tokens(inputs)
        if cache is None:
            cache = [None] * len(self.layers)
        mask = create_attention_mask(h, cache[0])
        for layer, c in zip(self.layers, cache):
            h = layer(h, mask, cache=c)
        return self.norm(h)


class PerRowTemperature(llama4.Attention):
    """Llama 4's attention whose NoPE temperature takes a position per row."""

    def _temperature(self, offset, length: int) -> mx.array:
        """The query scale of each position (broadcast over heads and dims): log(floor(p /
        floor_scale) + 1) * attn_scale + 1 for positions p = offset + 1 .. offset + length."""
        if isinstance(offset, mx.array) and offset.ndim == 1:
            positions = offset[:, None, None] + mx.arange(1, length + 1)[:, None]  # (B, L, 1)
            positions = positions[:, None]  # (B, 1, L, 1)
        else:
            positions = mx.arange(offset + 1, offset + length + 1)[:, None]  # (L, 1)
        return mx.log(mx.floor(positions / self.floor_scale) + 1.0) * self.attn_scale + 1.0

    def __call__(self, x: mx.array, mask=None, cache=None) -> mx.array:
        batch, length, _ = x.shape
        heads = (self.n_heads, self.n_kv_heads, self.n_kv_heads)
        queries, keys, values = (p(x).reshape(batch, length, n, -1).transpose(0, 2, 1, 3)
                                 for p, n in zip((self.q_proj, self.k_proj, self.v_proj), heads))
        offset = cache.offset if cache is not None else 0
        if self.use_rope:
            queries = self.rope(queries, offset=offset)
            keys = self.rope(keys, offset=offset)
        if self.use_qk_norm:
            queries = mx.fast.rms_norm(queries, weight=None, eps=1e-6)
            keys = mx.fast.rms_norm(keys, weight=None, eps=1e-6)
        if self.attn_temperature_tuning and not self.use_rope:
            queries = (queries * self._temperature(offset, length)).astype(queries.dtype)
        if cache is not None:
            keys, values = cache.update_and_fetch(keys, values)
        out = scaled_dot_product_attention(queries, keys, values, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(batch, length, -1))


class WithinChunkCaches(llama4.Model):
    """The Llama 4 wrapper whose layers all get plain KV caches (chunked ones keep every
    position below the chunk size anyway)."""

    def make_cache(self) -> list[KVCache]:
        return [KVCache() for _ in self.layers]


def serve_within_chunk(model: nn.Module) -> int | None:
    """Swap Llama 4's text model, attentions and cache list for their within-chunk forms, in
    place; the chunk size (the context the runtime must not exceed), or None for other models."""
    if type(model) is not llama4.Model:
        return None
    model.__class__ = WithinChunkCaches
    for _, module in model.named_modules():
        if type(module) is llama4.LlamaModel:
            module.__class__ = WithinChunk
        elif type(module) is llama4.Attention:
            module.__class__ = PerRowTemperature
    return int(model.args.text_config.attention_chunk_size)
