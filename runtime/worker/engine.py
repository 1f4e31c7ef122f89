"""Runs scheduler steps on the model: prefill chunks and chained, batched decode."""

from __future__ import annotations

import time
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.protocol.worker import DecodeBatch, PrefillChunk, Step
from runtime.worker.discovery import CacheLayout
from runtime.worker.kv_pool import KVPool
from runtime.worker.pool_cache import ForwardBatch, PoolLayerCache


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device but not read back yet."""

    step_id: int
    tokens: mx.array | None
    launched_at: float


class Engine:
    """Owns the model, the KV pool and the host-side request→slot table.

    Chaining: a decode row whose input token is -1 takes the token this engine sampled
    for that row in the previous decode batch, as a lazy array (never read back first).
    """

    def __init__(self, model: nn.Module, layout: CacheLayout, pool: KVPool, max_rows: int, max_context: int) -> None:
        self.model = model
        self.layout = layout
        self.pool = pool
        self.max_context = max_context
        self.slot_table = np.zeros((max_rows, max_context), dtype=np.int32)
        self._prev_tokens: mx.array | None = None
        self._prev_index: dict[int, int] = {}

    def _caches(self, batch: ForwardBatch) -> list:
        return [
            PoolLayerCache(self.pool, kv_i, batch) if kv_i >= 0 else None
            for kv_i in self.layout.kv_index
        ]

    def _prefill(self, chunk: PrefillChunk) -> None:
        row, start, n = chunk.row, chunk.start, len(chunk.token_ids)
        if chunk.prefix_slots:
            self.slot_table[row, : len(chunk.prefix_slots)] = chunk.prefix_slots
        if n == 0:
            return  # a full-prefix hit only sets the table row
        self.slot_table[row, start : start + n] = chunk.slot_ids
        gather = None if start == 0 else mx.array(self.slot_table[row : row + 1, : start + n])
        batch = ForwardBatch(
            write_slots=mx.array(chunk.slot_ids, dtype=mx.int32),
            gather_index=gather,
            offset=start,
            mask=None,
            num_new=n,
        )
        self.model(mx.array(chunk.token_ids, dtype=mx.int32)[None], cache=self._caches(batch))

    def _decode_inputs(self, decode: DecodeBatch) -> mx.array:
        rows, token_ids = decode.rows, decode.token_ids
        if self._prev_tokens is not None and all(t < 0 for t in token_ids):
            if [self._prev_index.get(r, -1) for r in rows] == list(range(len(rows))) and len(rows) == self._prev_tokens.size:
                return self._prev_tokens
        explicit = mx.array([max(t, 0) for t in token_ids], dtype=mx.int32)
        chained = [t < 0 for t in token_ids]
        if not any(chained):
            return explicit
        assert self._prev_tokens is not None, "chained decode without a previous decode step"
        prev_idx = mx.array([self._prev_index[r] if t < 0 else 0 for r, t in zip(rows, token_ids)], dtype=mx.int32)
        return mx.where(mx.array(chained), self._prev_tokens[prev_idx], explicit)

    def _decode(self, decode: DecodeBatch) -> mx.array:
        rows = np.asarray(decode.rows, dtype=np.int64)
        positions = np.asarray(decode.positions, dtype=np.int64)
        self.slot_table[rows, positions] = decode.slot_ids
        bsz = len(decode.rows)
        length = int(positions.max()) + 1
        gather = mx.array(self.slot_table[rows, :length])
        if bsz == 1:
            offset: int | mx.array = int(positions[0])
            mask = None
        else:
            offset = mx.array(positions.astype(np.int32))
            valid = np.arange(length)[None, :] <= positions[:, None]
            mask = mx.array(valid)[:, None, None, :]
        batch = ForwardBatch(
            write_slots=mx.array(decode.slot_ids, dtype=mx.int32),
            gather_index=gather,
            offset=offset,
            mask=mask,
            num_new=1,
        )
        inputs = self._decode_inputs(decode)
        logits = self.model(inputs[:, None], cache=self._caches(batch))[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1).astype(mx.int32)
        temps = decode.temperatures
        if any(t > 0 for t in temps):
            inv = mx.array([1.0 / t if t > 0 else 1.0 for t in temps], dtype=logprobs.dtype)
            sampled = mx.random.categorical(logprobs * inv[:, None]).astype(mx.int32)
            tokens = mx.where(mx.array([t > 0 for t in temps]), sampled, tokens)
        self._prev_tokens = tokens
        self._prev_index = {r: i for i, r in enumerate(decode.rows)}
        return tokens

    def launch(self, step: Step) -> LaunchedStep:
        """Queue a step's work on the device without waiting for it."""
        for chunk in step.prefills:
            self._prefill(chunk)
        tokens = self._decode(step.decode) if step.decode is not None and step.decode.rows else None
        targets = self.pool.arrays() + ([tokens] if tokens is not None else [])
        mx.async_eval(*targets)
        return LaunchedStep(step.step_id, tokens, time.perf_counter())

    def finalize(self, launched: LaunchedStep) -> list[int]:
        """Read a launched step's sampled tokens back as plain ints."""
        if launched.tokens is None:
            mx.eval(self.pool.arrays())
            return []
        return launched.tokens.tolist()

    def reset_chain(self) -> None:
        self._prev_tokens = None
        self._prev_index = {}
