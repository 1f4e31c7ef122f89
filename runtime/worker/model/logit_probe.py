"""The load-time probe of a model transformation: logits on a short prompt, before and after.

A transformation that should not change a single bit (a fused operation, a value computed once
instead of every call) is kept only where the model's logits on this prompt stay bit-identical.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn


def probe_tokens(vocab_size: int) -> mx.array:
    """Six token ids spread over the vocabulary, one row."""
    return mx.array([[(7 * i + 3) % vocab_size for i in range(6)]], dtype=mx.uint32)


def probe_logits(model: nn.Module, tokens: mx.array) -> mx.array | None:
    """The model's logits on ``tokens`` (evaluated), or None where the model cannot be called so."""
    try:
        out = model(tokens)
        out = out[0] if isinstance(out, tuple) else out
        mx.eval(out)
        return out
    except Exception:  # noqa: BLE001 - a model the probe cannot call is left as it is
        return None


def same_logits(before: mx.array | None, after: mx.array | None) -> bool:
    """Whether both probes ran and agree bit for bit."""
    return (before is not None and after is not None and after.shape == before.shape
            and mx.array_equal(after, before).item())
