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


class LogitProbe:
    """The model's logits on the probe prompt, computed once at the first transformation that
    asks and compared against after each one: a kept transformation leaves them bit-identical
    and a reverted one restores the model, so every later one compares against the same."""

    def __init__(self, model: nn.Module, vocab_size: int) -> None:
        self.model = model
        self.tokens = probe_tokens(vocab_size) if vocab_size > 0 else None
        self._reference: mx.array | None = None
        self._computed = False

    def reference(self) -> mx.array | None:
        """The logits before any transformation (None: the model cannot be probed)."""
        if not self._computed:
            self._reference = probe_logits(self.model, self.tokens) if self.tokens is not None else None
            self._computed = True
        return self._reference

    def unchanged(self) -> bool:
        """Whether the model's logits now are bit-identical to the reference."""
        return self.tokens is not None and same_logits(self.reference(), probe_logits(self.model, self.tokens))
