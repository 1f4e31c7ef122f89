"""Token choice from a decode step's logits."""

from __future__ import annotations

import mlx.core as mx


def sample(logits: mx.array, temperatures: list[float]) -> mx.array:
    """Greedy tokens (argmax of the log-probabilities, as mlx-lm), sampled where temperature > 0."""
    logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
    tokens = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if any(t > 0 for t in temperatures):  # not max(): one NaN would hide the others
        # 1/t in float32: a small temperature overflows float16/bf16 logits.
        inv = mx.array([1.0 / t if t > 0 else 1.0 for t in temperatures], dtype=mx.float32)
        sampled = mx.random.categorical(logprobs.astype(mx.float32) * inv[:, None]).astype(mx.int32)
        tokens = mx.where(mx.array([t > 0 for t in temperatures]), sampled, tokens)
    return tokens
