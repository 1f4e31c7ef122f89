"""The host-side shape of one decode batch: padded rows, attended length, whether to mask."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from runtime.protocol.worker import DecodeBatch


def row_bucket(rows: int) -> int:
    """Batch rows rounded up to a few size classes: powers of two to 8, then multiples of 16 to
    64, of 32 to 256, of 64 beyond. Each class is a compiled decode trace per tail length and
    launch shape (on a GPU, kernel builds the first time): under mixed traffic the row count
    changes every few steps, and a padding row costs a GPU decode step next to nothing."""
    if rows <= 8:
        return 1 << (rows - 1).bit_length()
    step = 16 if rows <= 64 else 32 if rows <= 256 else 64
    return -(-rows // step) * step


def row_classes(max_rows: int, smallest: int = 1) -> list[int]:
    """The row classes (``row_bucket``) of batches of ``smallest`` to ``max_rows`` rows, ascending."""
    return sorted({row_bucket(n) for n in range(smallest, max_rows + 1)})


def round_length(length: int, bucket: int, max_context: int) -> int:
    """``length`` rounded up to a multiple of ``bucket``, at most ``max_context``."""
    return min(-(-length // bucket) * bucket, max_context)


def bucket_lengths(bucket: int, max_context: int) -> list[int]:
    """Every value ``round_length`` can give for lengths up to ``max_context``."""
    return [min(n, max_context) for n in range(bucket, max_context + bucket, bucket)]


@dataclass
class DecodePlan:
    """``rows``/``positions``/``slot_ids``/``aux_slots`` include ``pad`` padding rows at the end.

    ``compact``: the batch is rows ``0..B-1`` in order; ``lockstep``: also all at one position
    (row-cache path only). ``length``: how many positions each row attends to.
    """

    rows: np.ndarray
    positions: np.ndarray
    slot_ids: list[int]
    aux_slots: list[int]
    pad: int
    length: int
    compact: bool
    lockstep: bool

    def valid(self) -> np.ndarray:
        """(B, length) bool: which attended positions each row may see."""
        return np.arange(self.length)[None, :] <= self.positions[:, None]


def plan_decode(decode: DecodeBatch, *, dense: bool, length_bucket: int, max_context: int, padding_row: int) -> DecodePlan:
    """Plan a decode batch for the row cache (``dense``) or for the pool paths.

    Row cache: no padding rows (they would write into rows other requests own) and the exact
    length in use (its views cost no new buffers as the length grows). Pool paths: rows padded
    to ``row_bucket`` sizes (padding rows use ``padding_row``, position 0, slot 0) and the
    length rounded up to ``length_bucket``: the same shapes recur for many steps, so MLX reuses
    its buffers instead of faulting in new ones every step.
    """
    rows = np.asarray(decode.rows, dtype=np.int64)
    positions = np.asarray(decode.positions, dtype=np.int64)
    bsz = len(decode.rows)
    compact = dense and bool(np.array_equal(rows, np.arange(bsz)))
    lockstep = compact and bool((positions == positions[0]).all())
    if dense:
        length = int(positions.max()) + 1
    else:
        length = round_length(int(positions.max()) + 1, length_bucket, max_context)
    pad = 0 if dense else row_bucket(bsz) - bsz
    slot_ids = list(decode.slot_ids)
    aux_slots = list(decode.aux_slots)
    if pad:
        rows = np.concatenate([rows, np.full(pad, padding_row, dtype=rows.dtype)])
        positions = np.concatenate([positions, np.zeros(pad, dtype=positions.dtype)])
        slot_ids += [0] * pad
        aux_slots += [0] * pad if aux_slots else []
    return DecodePlan(rows, positions, slot_ids, aux_slots, pad, length, compact, lockstep)
