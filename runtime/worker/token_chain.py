"""Chained lazy decode: a decode row takes the token its previous step sampled, unread.

The scheduler sends -1 as a row's input token when that row's token is the one the worker
sampled for it in the previous decode batch: the worker builds step N+1 from step N's lazy
tokens before step N is read back, so the host never waits on the device between steps.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.protocol.worker import DecodeBatch


class TokenChain:
    """The previous decode batch's sampled tokens (lazy) and the rows they belong to."""

    def __init__(self) -> None:
        self.tokens: mx.array | None = None
        self.rows: list[int] = []

    def inputs(self, decode: DecodeBatch) -> mx.array:
        """The batch's input tokens, (rows,) int32: explicit ones, and chained ones (-1) taken
        from the previous batch's tokens by row."""
        rows, token_ids = decode.rows, decode.token_ids
        if self.tokens is not None and rows == self.rows and max(token_ids) < 0:
            return self.tokens  # the common case: the same rows, every one chained
        explicit = mx.array([max(t, 0) for t in token_ids], dtype=mx.int32)
        chained = [t < 0 for t in token_ids]
        if not any(chained):
            return explicit
        assert self.tokens is not None, "chained decode without a previous decode step"
        prev_index = {r: i for i, r in enumerate(self.rows)}
        prev_idx = mx.array([prev_index[r] if t < 0 else 0 for r, t in zip(rows, token_ids)], dtype=mx.int32)
        return mx.where(mx.array(chained), self.tokens[prev_idx], explicit)

    def keep(self, rows: list[int], tokens: mx.array) -> None:
        """A decode batch's sampled tokens: the next chained batch takes them as input."""
        self.tokens, self.rows = tokens, rows

    def reset(self) -> None:
        self.tokens, self.rows = None, []
