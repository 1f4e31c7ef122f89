"""Prompt logprobs: each prompt token's log-probability given the tokens before it.

A prefill chunk that asks (``PrefillChunk.logprob_targets``, the token after each of its
tokens) keeps its forward's logits, which a prefill otherwise never evaluates: the model's own
log-softmax in float32, as decode logprobs are (``sampling_ops.chosen_and_top``), taken in
blocks of rows so that a long chunk's float32 copy of its logits stays bounded.
"""

from __future__ import annotations

import mlx.core as mx

from runtime.protocol.worker import PrefillChunk, PromptLogprobs
from runtime.worker.sampling_ops import chosen_and_top

BLOCK_ROWS = 256  # positions per log-softmax: a block's float32 logits are BLOCK_ROWS x vocabulary


def prompt_logprobs(logits: mx.array, targets: list[int], top_n: int) -> tuple[mx.array, ...]:
    """(chosen logprobs, top ids, top logprobs) of ``logits`` (positions x vocabulary) for the
    ``targets`` that follow each position; lazy. Without ``top_n``, only the first is meant
    (``chosen_and_top`` repeats it)."""
    target_ids = mx.array(targets, dtype=mx.int32)
    parts = [chosen_and_top(top_n, logits[at:at + BLOCK_ROWS], target_ids[at:at + BLOCK_ROWS])
             for at in range(0, len(targets), BLOCK_ROWS)]
    return parts[0] if len(parts) == 1 else tuple(mx.concatenate(list(outputs)) for outputs in zip(*parts))


def read_prompt_logprobs(arrays: list[tuple[PrefillChunk, mx.array, mx.array, mx.array]]) -> list[PromptLogprobs]:
    """Each asking chunk's logprobs as plain numbers (evaluated)."""
    mx.eval([a for entry in arrays for a in entry[1:]])
    return [PromptLogprobs(row=chunk.row, start=chunk.start, logprobs=chosen.tolist(),
                           top_ids=top_ids.tolist() if chunk.top_logprobs else [],
                           top_logprobs=top_values.tolist() if chunk.top_logprobs else [])
            for chunk, chosen, top_ids, top_values in arrays]
