"""Messages between clients and the scheduler (one ROUTER socket at the scheduler)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

import msgspec

MAX_RID_LEN = 256
"""Longest request id a client may choose (every reply repeats it)."""

Rid = Annotated[str, msgspec.Meta(max_length=MAX_RID_LEN)]


class Generate(msgspec.Struct, tag="generate", omit_defaults=True, forbid_unknown_fields=True):
    """Start a generation. Exactly one of ``prompt``, ``token_ids`` or ``messages`` is set.

    ``rid`` is the client's own id for the request, scoped to its connection: two clients
    may use the same one, and only the sender can abort it. A REQ socket gets exactly one
    reply per request, so its requests never stream. ``messages`` (OpenAI chat messages) go
    through the model folder's chat template, with ``chat_template_kwargs`` and ``tools``.
    Sampling parameters follow OpenAI's and vLLM's names; the scheduler checks their ranges.
    At most one of ``json_schema``, ``regex``, ``grammar`` (Lark or GBNF text) and
    ``json_object`` constrains the output (``runtime/scheduler/grammar.py``).
    ``prompt_logprobs`` (the number of top logprobs, 0 or more): the result also carries each
    prompt token's logprob given the tokens before it; such a prompt runs whole (no prefix-cache hit).
    """

    rid: Rid
    prompt: str | None = None
    token_ids: list[int] | None = None
    messages: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    max_tokens: int = 256
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[int, float] | None = None
    seed: int | None = None
    min_tokens: int = 0
    stop: list[str] | None = None
    logprobs: bool = False
    top_logprobs: int = 0
    prompt_logprobs: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = []
    stream: bool = False
    json_schema: dict[str, Any] | None = None
    regex: str | None = None
    grammar: str | None = None
    json_object: bool = False


class Abort(msgspec.Struct, tag="abort", forbid_unknown_fields=True):
    """End a running or waiting request of this connection; its result comes back with finish_reason "abort"."""

    rid: Rid


class StatusQuery(msgspec.Struct, tag="status", forbid_unknown_fields=True):
    """Ask for model and queue facts."""

    rid: Rid


ClientMsg = Union[Generate, Abort, StatusQuery]

FinishReason = Literal["stop", "length", "abort", "error"]


class TokenLogprob(msgspec.Struct, array_like=True):
    """One generated token's log-probability (the model's log-softmax, before any filter) and
    the ``top`` most likely tokens at that position as (token id, logprob), best first."""

    token_id: int
    logprob: float
    top: list[tuple[int, float]] = []


class Chunk(msgspec.Struct, tag="chunk", omit_defaults=True):
    """New tokens of a streaming request and the text they completed."""

    rid: str
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None


class ChunkBatch(msgspec.Struct, tag="chunks"):
    """Every chunk one step produced for one client, in one message."""

    chunks: list[Chunk]


class Done(msgspec.Struct, tag="done", omit_defaults=True):
    """The final result of a request (also the error reply for a rejected one).

    ``stop_reason``: the stop string or stop token id that ended it (None for EOS or length).
    ``queue_s``: seconds from its arrival to its admission (the step of its first prefill);
    None when it was never admitted. With ``prompt_logprobs`` asked: ``prompt_ids`` (the prompt as
    run) and ``prompt_logprobs``, one entry for each prompt token after the first.
    """

    rid: str
    finish_reason: FinishReason
    token_ids: list[int] = []
    text: str = ""
    prompt_tokens: int = 0
    cached_tokens: int = 0
    error: str | None = None
    logprobs: list[TokenLogprob] | None = None
    stop_reason: str | int | None = None
    queue_s: float | None = None
    prompt_ids: list[int] | None = None
    prompt_logprobs: list[TokenLogprob] | None = None


class StatusReply(msgspec.Struct, tag="status_reply"):
    """Model and queue facts for ``runtime status``.

    ``worker_state``: "up"; "starting" before the first worker is ready (requests wait for it;
    the counts and limits are then the config's, 0 where the worker chooses); or "restarting"
    while no worker is serving (new requests are refused then; waiting ones run once it is
    back). ``max_running``, ``max_step_tokens``, ``prefill_chunk`` and ``max_context``: the
    limits the worker runs with (the config's, or chosen for the device). ``worker_prefill_shapes``/``worker_decode_traces``: distinct
    prefill shapes run and decode traces compiled by the worker so far (as of its last step).
    ``mask_s``/``mask_steps``: seconds the scheduler spent computing grammar masks (structured
    output) and the steps that needed them, since the worker last started.
    """

    rid: str
    model: str
    model_type: str
    waiting: int
    running: int
    kv_slots_total: int
    kv_slots_free: int
    kv_slots_cached: int
    worker_restarts: int
    max_context: int
    worker_pid: int
    aux_slots_total: int = 0
    aux_slots_free: int = 0
    aux_slots_cached: int = 0
    steps: int = 0
    worker_idle_s: float = 0.0
    worker_uptime_s: float = 0.0
    worker_state: str = "up"
    max_waiting: int = 0
    max_message_bytes: int = 0
    clients: int = 0
    replies_queued: int = 0
    max_running: int = 0
    max_step_tokens: int = 0
    prefill_chunk: int = 0
    worker_prefill_shapes: int = 0
    worker_decode_traces: int = 0
    mask_s: float = 0.0
    mask_steps: int = 0


class ProtocolError(msgspec.Struct, tag="protocol_error"):
    """Reply to a message that could not be decoded; ``rid`` is "" when unknown."""

    rid: str
    message: str


class AbortReply(msgspec.Struct, tag="abort_reply"):
    """Answer to ``Abort``: whether a request with that id was waiting or running."""

    rid: str
    found: bool


class Ping(msgspec.Struct, tag="ping"):
    """Sent now and then to a DEALER client with requests in flight, so the service notices when
    it has gone (its requests are then aborted). Clients ignore it. REQ clients never get one."""


ServerMsg = Union[Chunk, ChunkBatch, Done, StatusReply, ProtocolError, AbortReply, Ping]

client_encoder = msgspec.msgpack.Encoder()
client_msg_decoder = msgspec.msgpack.Decoder(ClientMsg)
server_msg_decoder = msgspec.msgpack.Decoder(ServerMsg)
