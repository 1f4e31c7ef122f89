"""A prefill forward whose rows start at different positions (a hybrid's chunks of one round).

Each row's new tokens sit at its own start: RoPE takes the starts as a (B,) offset, each row
gathers its own positions 0..start+length from the pool (padding slot 0 past them), and an
explicit mask shows every query the keys at or before its own position. Not with a row cache,
a sliding window or KV-shared layers, which need one start a forward (``Engine.mixed_starts``).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from runtime.protocol.worker import PrefillChunk
from runtime.worker.paths.pool_cache import ForwardBatch


def mixed_start_mask(starts: np.ndarray, length: int, keys: int, rank: int) -> mx.array:
    """(B, .., length, keys) bool: query t of row b sees keys 0..starts[b] + t, shaped to
    broadcast against a ``rank``-D score array (batch axis first)."""
    visible = np.arange(keys)[None, None, :] <= starts[:, None, None] + np.arange(length)[None, :, None]
    return mx.array(visible).reshape((len(starts),) + (1,) * (rank - 3) + (length, keys))


def mixed_prefill_batch(slot_table: np.ndarray, group: list[PrefillChunk], length: int, rows: int, keys: int,
                        mask_rank: int) -> ForwardBatch:
    """The forward batch of ``group``'s chunks, each padded at the end to ``length``, padding rows
    (start 0, no tokens) up to ``rows``; ``keys`` (at least the largest start + ``length``)
    positions gathered a row. The table holds every chunk's slots already (``admit_chunk``)."""
    assert keys >= max(c.start for c in group) + length
    starts = np.zeros(rows, dtype=np.int32)
    index = np.zeros((rows, keys), dtype=np.int32)
    for i, chunk in enumerate(group):
        end = chunk.start + len(chunk.token_ids)
        starts[i] = chunk.start
        index[i, :end] = slot_table[chunk.row, :end]
    return ForwardBatch(write_slots=padded_write_slots(group, length, rows), gather_index=mx.array(index),
                        offset=mx.array(starts), mask=mixed_start_mask(starts, length, keys, mask_rank))


def padded_write_slots(group: list[PrefillChunk], length: int, rows: int) -> mx.array:
    """(rows * length,) pool slots for a prefill forward's new K/V, row-major: each chunk's own,
    then the padding slot 0 for its padding positions and for the padding rows."""
    slots = [s for c in group for s in c.slot_ids + [0] * (length - len(c.token_ids))]
    slots += [0] * (length * (rows - len(group)))
    return mx.array(slots, dtype=mx.int32)
