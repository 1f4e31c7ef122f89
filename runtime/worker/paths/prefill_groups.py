"""Which prefill chunks of one step run together as one batched forward."""

from __future__ import annotations

from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH, PrefillChunk

MIXED_PAD_FLOOR = 512  # tokens (rows x length) a hybrid's batch may pad to, however short its chunks


def prefill_groups(
    chunks: list[PrefillChunk], batchable: bool, max_padding: float, recurrent: bool = False,
    pads_recurrent: bool = False, mixed_starts: bool = False,
) -> list[list[PrefillChunk]]:
    """Batches of prefill chunks, in an order that runs every chunk after those it reads.

    A chunk starting at position s reads only positions below s (its own row's earlier
    chunks, a cached prefix, a saved recurrent state), all written by chunks that start below
    s; so the chunks are taken in order of start (stably), and the chunks of one start, one
    per row, are independent of one another. Those are sorted by length and cut into batches
    whose padding (shorter chunks are padded at the end; causal attention keeps real tokens
    blind to it) stays within ``max_padding`` of the real tokens. ``recurrent`` (models with
    recurrent state): a batch's rows either all start from an empty state or all from saved
    ones, and no padding unless ``pads_recurrent`` (the model's recurrent layers honour the
    real lengths, ``padding_probe``). ``batchable`` False keeps every chunk on its own, in the
    given order.

    ``mixed_starts`` (a recurrent model whose forward takes each row's own start,
    ``Engine.mixed_starts``): the chunks may also be taken in rounds (``state_rounds``), so that
    chunks of different starts share a forward; whichever order gives fewer batches is used. A
    hybrid's step would otherwise run a forward, and wait for it, for every start its chunks
    have (a prompt's tail past its tracking point, each prefix hit's suffix). Where such a model
    pads, a batch may also pad up to ``MIXED_PAD_FLOOR`` tokens in all: its forward costs about
    the same at that size whatever the padding, and each batch less is a forward less.
    """
    if not batchable:
        return [[chunk] for chunk in chunks]
    if recurrent and not pads_recurrent:
        max_padding = 0.0
    pad_floor = MIXED_PAD_FLOOR if mixed_starts and max_padding > 0 else 0
    by_start = _batches(chunks, [c.start for c in chunks], recurrent, max_padding, pad_floor)
    if not mixed_starts:
        return by_start
    by_round = _batches(chunks, state_rounds(chunks), recurrent, max_padding, pad_floor)
    return by_round if len(by_round) < len(by_start) else by_start


def _batches(chunks: list[PrefillChunk], order: list[int], recurrent: bool, max_padding: float, pad_floor: int
             ) -> list[list[PrefillChunk]]:
    """The chunks of each ``order`` value (and, for a recurrent model, of one kind of starting
    state) cut into batches by length, in ascending ``order``; whole-prefix hits on their own."""
    runs: dict[tuple[int, bool], list[PrefillChunk]] = {}
    first: dict[tuple[int, bool], int] = {}
    singles: list[tuple[int, int, PrefillChunk]] = []
    for i, chunk in enumerate(chunks):
        if not chunk.token_ids:  # a full-prefix hit: only table and state updates
            singles.append((order[i], i, chunk))
            continue
        key = (order[i], recurrent and chunk.aux_source == AUX_FRESH)
        runs.setdefault(key, []).append(chunk)
        first.setdefault(key, i)
    ordered: list[tuple[int, int, list[PrefillChunk]]] = []
    for key, run in runs.items():
        current: list[PrefillChunk] = []
        real = 0
        for chunk in sorted(run, key=lambda c: len(c.token_ids)):
            n = len(chunk.token_ids)
            padded = (len(current) + 1) * n
            if current and padded > (1 + max_padding) * (real + n) and padded > pad_floor:
                ordered.append((key[0], first[key], current))
                current, real = [], 0
            current.append(chunk)
            real += n
        ordered.append((key[0], first[key], current))
    ordered += [(rank, i, [chunk]) for rank, i, chunk in singles]
    ordered.sort(key=lambda item: (item[0], item[1]))
    return [group for _, _, group in ordered]


def state_rounds(chunks: list[PrefillChunk]) -> list[int]:
    """Each chunk's round: 0, or one past the round of every chunk of this step whose recurrent
    state it starts from (its row's chunk before it, or the chunk that snapshots the slot it
    restores, a prefix another prompt of this step cached). Chunks of one round read no state
    another one of them writes; the K/V a chunk reads of another prompt were written by that
    snapshot's chunk or those before it, so in an earlier round too."""
    rounds: list[int] = []
    live: dict[int, int] = {}  # a live slot -> the round of the last chunk writing it
    snapshots: dict[int, int] = {}  # a snapshot slot -> the round of the chunk writing it
    for chunk in chunks:
        source = chunk.aux_slot if chunk.aux_source == AUX_CONTINUE else chunk.aux_source
        after = live.get(source, -1) if chunk.aux_source == AUX_CONTINUE else snapshots.get(source, -1)
        n = after + 1
        rounds.append(n)
        live[chunk.aux_slot] = n
        if chunk.aux_snapshot >= 0:
            snapshots[chunk.aux_snapshot] = n
    return rounds
