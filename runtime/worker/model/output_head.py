"""The model's output head over a batch's first rows only, for forwards that read no more.

A fused step's forward (``paths/cuda/fused_step``) carries every prefill token as a row beside
the decode rows, and only the decode rows' logits are read: the head over the prefill rows
(hidden x vocabulary per row, about a fifth of a 1B's arithmetic per token, and a rows x
vocabulary buffer) is waste. mlx-lm's models end in ``lm_head(out)`` or, with tied embeddings,
``embed_tokens.as_linear(out)``; inside ``first_rows(n)`` both take only the first ``n`` rows of
their input (a view), so the head runs on exactly the rows, and the shape, an unfused decode
step gives it. A model whose head is neither keeps computing every row: slower, never wrong,
since the caller slices the logits to its rows either way.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn


class _FirstRows(nn.Module):
    """Stands in for an ``lm_head`` module while ``OutputHead.first_rows`` is active."""

    def __init__(self, head: nn.Module, rows: int) -> None:
        super().__init__()
        self.head, self.rows = head, rows

    def __call__(self, x: mx.array) -> mx.array:
        return self.head(x[: self.rows])


class OutputHead:
    """Where a model's output projection sits, found once at load: ``lm_head`` children of the
    model and of its language model, and their embeddings (for tied heads)."""

    def __init__(self, model: nn.Module) -> None:
        owners = [model]
        for name in ("language_model", "model"):
            inner = model.get(name) if isinstance(model, dict) else None
            if isinstance(inner, nn.Module):
                owners.append(inner)
                nested = inner.get("model")
                if isinstance(nested, nn.Module):
                    owners.append(nested)
        self._heads = [owner for owner in owners if isinstance(owner.get("lm_head"), nn.Module)]
        self._embeddings = [owner["embed_tokens"] for owner in owners
                            if isinstance(owner.get("embed_tokens"), nn.Module)
                            and callable(getattr(owner["embed_tokens"], "as_linear", None))]
        self._active = False

    @property
    def found(self) -> bool:
        return bool(self._heads or self._embeddings)

    @contextmanager
    def first_rows(self, rows: int) -> Iterator[None]:
        """While active, the head computes only the first ``rows`` rows of its input."""
        if self._active:
            raise RuntimeError("OutputHead.first_rows does not nest")
        self._active = True
        heads = [(owner, owner["lm_head"]) for owner in self._heads]
        try:
            for owner, head in heads:
                owner["lm_head"] = _FirstRows(head, rows)
            for embedding in self._embeddings:
                embedding.as_linear = _sliced(embedding.as_linear, rows)  # an instance attribute shadows the method
            yield
        finally:
            for owner, head in heads:
                owner["lm_head"] = head
            for embedding in self._embeddings:
                embedding.__dict__.pop("as_linear", None)
            self._active = False


def _sliced(as_linear: Callable[[mx.array], mx.array], rows: int) -> Callable[[mx.array], mx.array]:
    return lambda x: as_linear(x[:rows])
