"""Which prefill chunks of one step run together as one batched forward."""

from __future__ import annotations

from runtime.protocol.worker import PrefillChunk


def prefill_groups(chunks: list[PrefillChunk], batchable: bool, max_padding: float) -> list[list[PrefillChunk]]:
    """Batches of prefill chunks, in an order that keeps every row's chunks in sequence.

    A run of consecutive chunks of distinct rows with the same start is independent row by
    row, so it is sorted by length and cut into batches whose padding (shorter chunks are
    padded at the end; causal attention keeps real tokens blind to it) stays within
    ``max_padding`` of the real tokens. ``batchable`` False (models with recurrent state,
    which would need per-row lengths) keeps every chunk on its own.
    """
    runs: list[list[PrefillChunk]] = []
    for chunk in chunks:
        last = runs[-1] if runs else None
        if (
            last is not None
            and batchable
            and chunk.token_ids
            and last[0].token_ids
            and chunk.start == last[0].start
            and all(c.row != chunk.row for c in last)
        ):
            last.append(chunk)
        else:
            runs.append([chunk])
    groups: list[list[PrefillChunk]] = []
    for run in runs:
        current: list[PrefillChunk] = []
        real = 0
        for chunk in sorted(run, key=lambda c: len(c.token_ids)):
            n = len(chunk.token_ids)
            if current and (len(current) + 1) * n > (1 + max_padding) * (real + n):
                groups.append(current)
                current, real = [], 0
            current.append(chunk)
            real += n
        groups.append(current)
    return groups
