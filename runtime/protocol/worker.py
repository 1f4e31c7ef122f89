"""Messages between the scheduler and the MLX worker (one PAIR socket)."""

from __future__ import annotations

from typing import Union

import msgspec

AUX_FRESH = -2
AUX_CONTINUE = -1


class PrefillChunk(msgspec.Struct, array_like=True):
    """Run ``token_ids`` at positions ``start..`` of request row ``row``; no token is sampled.

    ``prefix_slots`` (set on a request's first chunk) are the slots of positions
    ``0..start`` already in the KV pool (a prefix-cache hit); ``slot_ids`` receive
    the new tokens' K/V.

    Hybrid models: ``aux_slot`` is the request's live auxiliary-state slot;
    ``aux_source`` says where the state comes from before this chunk (AUX_FRESH: empty,
    AUX_CONTINUE: the live slot, a slot id: restore that snapshot); ``aux_snapshot``,
    when set, receives a copy of the state after this chunk.

    ``logprob_targets`` (a prompt-logprobs request): the token after each of ``token_ids``;
    the worker reports each one's log-probability and the ``top_logprobs`` best there.
    """

    row: int
    start: int
    token_ids: list[int]
    slot_ids: list[int]
    prefix_slots: list[int] = []
    aux_slot: int = -1
    aux_source: int = AUX_CONTINUE
    aux_snapshot: int = -1
    logprob_targets: list[int] = []
    top_logprobs: int = 0


class PromptLogprobs(msgspec.Struct, array_like=True):
    """A prefill chunk's prompt logprobs: ``logprobs[i]`` is the log-probability of the chunk's
    ``logprob_targets[i]`` after its token i; ``top_ids``/``top_logprobs`` the best there."""

    row: int
    start: int
    logprobs: list[float]
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []


class RowSampling(msgspec.Struct, array_like=True, omit_defaults=True):
    """How request row ``row`` chooses its tokens, from its next decode on (sent once, at admission).

    The defaults are plain greedy. ``seed`` keys the row's random draws together with each
    token's position, so a seeded request samples the same tokens in any batch.
    ``stop_ids`` are masked while the scheduler says the row has not reached ``min_tokens``
    (``DecodeBatch.ban_stop``). ``logit_bias`` is (token id, bias) pairs.
    """

    row: int
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: list[tuple[int, float]] = []
    seed: int = 0
    stop_ids: list[int] = []
    logprobs: bool = False
    top_logprobs: int = 0


class DecodeBatch(msgspec.Struct, array_like=True):
    """One token for each listed request row, all in one forward pass.

    ``token_ids[i]`` is the input token of row i, or -1 to chain from the token the
    worker sampled for that row in the previous step (not read back yet).
    ``positions[i]`` is the token's position; ``slot_ids[i]`` receives its K/V;
    ``aux_slots[i]`` (hybrid models) is the row's live auxiliary-state slot.
    ``ban_stop`` lists the batch indices whose stop ids are masked in this step (min_tokens).
    ``mask_rows[j]`` is a batch index whose next token is constrained to ``masks[j]``: bit i
    of little-endian uint32 word i // 32 allows token i (structured output).
    ``deferred_rows`` are batch indices whose masks are not known yet (their input token is
    chained, not read back): they come in a ``Masks`` message for this step, which the worker
    waits for after it reported the previous step; the forward runs meanwhile.
    """

    rows: list[int]
    token_ids: list[int]
    positions: list[int]
    slot_ids: list[int]
    temperatures: list[float]
    aux_slots: list[int] = []
    ban_stop: list[int] = []
    mask_rows: list[int] = []
    masks: list[bytes] = []
    deferred_rows: list[int] = []


class Step(msgspec.Struct, tag="step"):
    """One scheduler step: prefill chunks, then a batched decode."""

    step_id: int
    prefills: list[PrefillChunk]
    decode: DecodeBatch | None
    released_rows: list[int] = []
    samplings: list[RowSampling] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Ask the worker to exit."""


class Masks(msgspec.Struct, tag="masks"):
    """The token masks of step ``step_id``'s ``deferred_rows``, in that order (same encoding as
    ``DecodeBatch.masks``); sent once the previous step's tokens advanced the grammars."""

    step_id: int
    masks: list[bytes]


WorkerCmd = Union[Step, Masks, Shutdown]


class Ready(msgspec.Struct, tag="ready"):
    """The model is loaded and the pools are allocated.

    The limits are those the worker runs with: the config's, or chosen for the device where
    the config leaves them unset (``limits`` describes them in one line for the log).
    """

    model_type: str
    num_slots: int
    max_rows: int
    max_context: int
    vocab_size: int
    dtype: str
    pool_bytes: int
    aux_slots: int = 0
    aux_bytes: int = 0
    max_step_tokens: int = 512
    prefill_chunk: int = 256
    limits: str = ""


class LoadFailed(msgspec.Struct, tag="load_failed"):
    """The model could not be loaded; ``error`` is the loader's message."""

    error: str


class StepDone(msgspec.Struct, tag="step_done"):
    """Finalized tokens of a step's decode batch, in the batch's row order.

    When a row of the batch asked for logprobs: ``logprobs[i]`` is token i's log-probability,
    ``top_ids[i]``/``top_logprobs[i]`` the most likely tokens (as many as the batch's largest
    ``top_logprobs``), for every row (the scheduler keeps those that asked).

    ``idle_s``: total time so far the worker had no step launched on the device;
    ``uptime_s``: time since the worker became ready (so idle share = idle_s / uptime_s).
    ``prefill_shapes``/``decode_traces``: distinct prefill forward shapes run and compiled
    decode traces made so far (warm-up included): what costs kernel builds on a GPU.
    ``prompt_logprobs``: those of the step's prefill chunks that asked.
    """

    step_id: int
    tokens: list[int]
    idle_s: float = 0.0
    uptime_s: float = 0.0
    logprobs: list[float] = []
    top_ids: list[list[int]] = []
    top_logprobs: list[list[float]] = []
    prefill_shapes: int = 0
    decode_traces: int = 0
    prompt_logprobs: list[PromptLogprobs] = []


class StepFailed(msgspec.Struct, tag="step_failed"):
    """A step raised inside the worker; the scheduler fails that step's requests."""

    step_id: int
    error: str


WorkerReply = Union[Ready, LoadFailed, StepDone, StepFailed]

worker_encoder = msgspec.msgpack.Encoder()
worker_cmd_decoder = msgspec.msgpack.Decoder(WorkerCmd)
worker_reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
