"""Messages between the scheduler and the MLX worker (one PAIR socket)."""

from __future__ import annotations

from typing import Union

import msgspec


class PrefillChunk(msgspec.Struct, array_like=True):
    """Run ``token_ids`` at positions ``start..`` of request row ``row``; no token is sampled.

    ``prefix_slots`` (set on a request's first chunk) are the slots of positions
    ``0..start`` already in the KV pool (a prefix-cache hit); ``slot_ids`` receive
    the new tokens' K/V.
    """

    row: int
    start: int
    token_ids: list[int]
    slot_ids: list[int]
    prefix_slots: list[int] = []


class DecodeBatch(msgspec.Struct, array_like=True):
    """One token for each listed request row, all in one forward pass.

    ``token_ids[i]`` is the input token of row i, or -1 to chain from the token the
    worker sampled for that row in the previous step (not read back yet).
    ``positions[i]`` is the token's position; ``slot_ids[i]`` receives its K/V.
    """

    rows: list[int]
    token_ids: list[int]
    positions: list[int]
    slot_ids: list[int]
    temperatures: list[float]


class Step(msgspec.Struct, tag="step"):
    """One scheduler step: prefill chunks, then a batched decode."""

    step_id: int
    prefills: list[PrefillChunk]
    decode: DecodeBatch | None
    released_rows: list[int] = []


class Shutdown(msgspec.Struct, tag="shutdown"):
    """Ask the worker to exit."""


WorkerCmd = Union[Step, Shutdown]


class Ready(msgspec.Struct, tag="ready"):
    """The model is loaded and the pools are allocated."""

    model_type: str
    num_slots: int
    max_rows: int
    max_context: int
    vocab_size: int
    dtype: str
    pool_bytes: int


class LoadFailed(msgspec.Struct, tag="load_failed"):
    """The model could not be loaded; ``error`` is the loader's message."""

    error: str


class StepDone(msgspec.Struct, tag="step_done"):
    """Finalized tokens of a step's decode batch, in the batch's row order."""

    step_id: int
    tokens: list[int]
    forward_s: float = 0.0


class StepFailed(msgspec.Struct, tag="step_failed"):
    """A step raised inside the worker; the scheduler fails that step's requests."""

    step_id: int
    error: str


WorkerReply = Union[Ready, LoadFailed, StepDone, StepFailed]

worker_encoder = msgspec.msgpack.Encoder()
worker_cmd_decoder = msgspec.msgpack.Decoder(WorkerCmd)
worker_reply_decoder = msgspec.msgpack.Decoder(WorkerReply)
