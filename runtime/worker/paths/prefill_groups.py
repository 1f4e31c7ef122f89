"""Which prefill chunks of one step run together as one batched forward."""

from __future__ import annotations

from runtime.protocol.worker import AUX_FRESH, PrefillChunk


def prefill_groups(
    chunks: list[PrefillChunk], batchable: bool, max_padding: float, recurrent: bool = False,
    pads_recurrent: bool = False,
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
    """
    if not batchable:
        return [[chunk] for chunk in chunks]
    if recurrent and not pads_recurrent:
        max_padding = 0.0
    runs: dict[tuple[int, bool], list[PrefillChunk]] = {}
    first: dict[tuple[int, bool], int] = {}
    singles: list[tuple[int, int, PrefillChunk]] = []
    for i, chunk in enumerate(chunks):
        if not chunk.token_ids:  # a full-prefix hit: only table and state updates
            singles.append((chunk.start, i, chunk))
            continue
        key = (chunk.start, recurrent and chunk.aux_source == AUX_FRESH)
        runs.setdefault(key, []).append(chunk)
        first.setdefault(key, i)
    ordered: list[tuple[int, int, list[PrefillChunk]]] = []
    for key, run in runs.items():
        start = key[0]
        current: list[PrefillChunk] = []
        real = 0
        for chunk in sorted(run, key=lambda c: len(c.token_ids)):
            n = len(chunk.token_ids)
            if current and (len(current) + 1) * n > (1 + max_padding) * (real + n):
                ordered.append((start, first[key], current))
                current, real = [], 0
            current.append(chunk)
            real += n
        ordered.append((start, first[key], current))
    ordered += [(start, i, [chunk]) for start, i, chunk in singles]
    ordered.sort(key=lambda item: (item[0], item[1]))
    return [group for _, _, group in ordered]

