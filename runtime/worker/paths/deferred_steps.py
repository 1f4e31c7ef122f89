"""Bookkeeping for decode steps whose K/V have not reached the KV pool yet."""

from __future__ import annotations

from collections.abc import Callable

import mlx.core as mx
import numpy as np

from runtime.protocol.worker import DecodeBatch


class DeferredSteps:
    """Where the K/V of the last few decode steps of one unchanged batch belong in the pool.

    A batch continues the record only when it has the same rows (and padding) and advances
    every row by one chained token; any other batch, or ``max_steps`` recorded steps (set by a
    batch's first step where ``steps_for`` is given), means the owner must move the K/V into
    the pool (``take``) first. The pool is read only by prefill and by batches that changed,
    so it is always complete when read.
    """

    def __init__(self, max_steps: int, steps_for: Callable[[int], int] | None = None) -> None:
        self.max_steps = max_steps
        self.steps_for = steps_for  # a batch's ``max_steps`` from its row count (padding included)
        self._key: tuple | None = None
        self._steps: list[tuple[np.ndarray, np.ndarray, list[int]]] = []  # (rows, positions, slots)

    def __len__(self) -> int:
        return len(self._steps)

    def continues(self, decode: DecodeBatch, pad: int) -> bool:
        return (
            bool(self._steps)
            and len(self._steps) < self.max_steps
            and (tuple(decode.rows), pad) == self._key
            and max(decode.token_ids) < 0
        )

    def add(self, decode: DecodeBatch, pad: int, rows: np.ndarray, positions: np.ndarray, slots: list[int]) -> None:
        """Record one step (padded ``rows``/``positions``/``slots``); flush before a batch change."""
        key = (tuple(decode.rows), pad)
        assert not self._steps or key == self._key, "take the recorded steps before changing the batch"
        if not self._steps and self.steps_for is not None:
            self.max_steps = self.steps_for(len(rows))
        self._key = key
        self._steps.append((rows, positions, slots))

    def kept_rows(self, decode: DecodeBatch, pad: int) -> list[int] | None:
        """For a batch that only dropped rows of the recorded one (the rest each advance by one
        chained token), where each of its rows sits in the recorded padded batch (-1 for its
        padding rows); None for any other batch, or when nothing is recorded."""
        if not self._steps or max(decode.token_ids) >= 0:
            return None
        assert self._key is not None
        where = {row: i for i, row in enumerate(self._key[0])}
        if any(row not in where for row in decode.rows):
            return None
        return [where[row] for row in decode.rows] + [-1] * pad

    def narrow(self, kept: list[int], rows: np.ndarray, decode: DecodeBatch, pad: int
               ) -> tuple[list[int], tuple[mx.array, mx.array, mx.array] | None]:
        """Keep only the recorded entries of ``kept`` (``kept_rows``; padding rows get ``rows``'
        padding row, position 0 and slot 0) as the record of the new batch (``rows`` padded).
        Returns where the dropped real rows sat and their entries (rows, positions, slots,
        step-major; None where none was dropped)."""
        assert self._key is not None
        staying = set(kept)
        dropped = [i for i in range(len(self._key[0])) if i not in staying]
        take = np.array([i if i >= 0 else 0 for i in kept])
        padding = np.array([i < 0 for i in kept])
        steps = [(rows, np.where(padding, 0, positions[take]), np.where(padding, 0, np.asarray(slots)[take]).tolist())
                 for _, positions, slots in self._steps]
        left = None
        if dropped:
            left = (mx.array(np.concatenate([r[dropped] for r, _, _ in self._steps]).astype(np.int32)),
                    mx.array(np.concatenate([p[dropped] for _, p, _ in self._steps]).astype(np.int32)),
                    mx.array(np.concatenate([np.asarray(s)[dropped] for _, _, s in self._steps]).astype(np.int32)))
        self._steps, self._key = steps, (tuple(decode.rows), pad)
        return dropped, left

    def take(self) -> tuple[mx.array, mx.array, mx.array] | None:
        """Rows, positions and slots of every recorded step, step-major; None when empty."""
        if not self._steps:
            return None
        rows = mx.array(np.concatenate([r for r, _, _ in self._steps]).astype(np.int32))
        positions = mx.array(np.concatenate([p for _, p, _ in self._steps]).astype(np.int32))
        slots = mx.array([s for _, _, step_slots in self._steps for s in step_slots], dtype=mx.int32)
        self.clear()
        return rows, positions, slots

    def clear(self) -> None:
        self._key = None
        self._steps = []
