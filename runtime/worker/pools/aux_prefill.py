"""A prefill forward's recurrent states: where each row's state comes from, and where it goes."""

from __future__ import annotations

import mlx.core as mx
from mlx_lm.models.cache import ArraysCache

from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH, PrefillChunk
from runtime.worker.pools.aux_pool import AuxPool


def prefill_caches(pool: AuxPool, group: list[PrefillChunk], length: int, rows: int) -> list[ArraysCache]:
    """One cache per aux entry for a forward over ``group``'s chunks, each padded at the end to
    ``length``, and ``rows`` rows (padding rows after the chunks', of length 0):
    every row from an empty state, or every row from a saved slot (``prefill_groups`` keeps the
    two apart; a padding row reads the reserved slot 0). Where rows are padded the caches are told
    the real lengths, which the model's recurrent layers honour (``padding_probe``: the engine
    pads only such models)."""
    padding = rows - len(group)
    sources = None
    if group[0].aux_source != AUX_FRESH:
        sources = mx.array([c.aux_slot if c.aux_source == AUX_CONTINUE else c.aux_source for c in group]
                           + [0] * padding, dtype=mx.int32)
    caches = pool.caches(sources)
    if padding or any(len(c.token_ids) < length for c in group):
        for cache in caches:
            cache.prepare(lengths=[len(c.token_ids) for c in group] + [0] * padding)
    return caches


def keep_prefill_states(pool: AuxPool, caches: list[ArraysCache], group: list[PrefillChunk]) -> None:
    """Write the states after the forward to each row's live slot, and to its snapshot slot where
    the chunk asks for one (a tracked boundary); padding rows' states are dropped."""
    n = len(group)
    for cache in caches:
        if any(state is not None and state.shape[0] > n for state in cache.cache):
            cache.cache = [state[:n] if state is not None else None for state in cache.cache]
    pool.store(caches, mx.array([c.aux_slot for c in group], dtype=mx.int32))
    snaps = [(i, c.aux_snapshot) for i, c in enumerate(group) if c.aux_snapshot >= 0]
    if snaps:
        index = mx.array([i for i, _ in snaps], dtype=mx.int32)
        slots = mx.array([s for _, s in snaps], dtype=mx.int32)
        for k, cache in enumerate(caches):
            pool.write(k, slots, [state[index] for state in cache.cache])
