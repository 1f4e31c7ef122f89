"""One record per request, holding everything the scheduler tracks about it."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.protocol.worker import RowSampling
from runtime.scheduler.params import SamplingChoice


@dataclass(frozen=True)
class SamplingParams(SamplingChoice):
    """What the client asked for, validated: the sampling choice (``runtime/scheduler/params.py``)
    plus the length and stop-token settings. ``seed`` is always set (random when the client gave none)."""

    max_tokens: int = 256
    ignore_eos: bool = False
    stop_token_ids: frozenset[int] = frozenset()
    prompt_logprobs: int = -1  # top logprobs per prompt token (0 or more), -1: none asked


@dataclass(eq=False)
class Request:
    """A request from admission to completion.

    Positions ``0..prompt_len-2`` are prefilled in chunks; the last prompt token is the
    input of the first decode step, which yields the first output token. ``slots[p]``
    holds the K/V of position p. The first ``cached_len`` slots belong to the radix tree
    (locked through ``tree_node``); the rest belong to this request.
    """

    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    client: Any = None
    stream: bool = False
    row: int = -1  # the request's batch row while admitted
    slots: list[int] = field(default_factory=list)
    prefix_len: int = 0
    prefilled: int = 0
    decodes_launched: int = 0
    output_ids: list[int] = field(default_factory=list)
    cached_len: int = 0
    tree_node: Any = None
    dup_slots: list[int] = field(default_factory=list)
    reserved: int = 0
    extra_ids: list[int] = field(default_factory=list)
    inflight_steps: int = 0
    finish_reason: str | None = None
    error: str | None = None
    detok: Any = None
    stop_matcher: Any = None
    text: str = ""  # text returned so far, when stop strings are matched
    stop_reason: str | int | None = None
    ended_by_token: bool = False  # the last output token is EOS or a stop token: not text
    logprobs: list[Any] = field(default_factory=list)  # (token id, logprob, top) per output token
    prompt_logprobs: list[Any] = field(default_factory=list)  # the same for prompt tokens 1.., when asked
    arrived_at: float = 0.0
    admitted_at: float = 0.0  # when it first got a row: its wait in the queue ends (0: not yet)
    constraint: Any = None  # grammar.Constraint of a structured-output request
    # Hybrid models: live aux slot, where its state starts, snapshot points and slots.
    aux_slot: int = -1
    aux_source: int = -2
    aux_started: bool = False
    aux_points: list[int] = field(default_factory=list)
    aux_snapshots: list[tuple[int, int]] = field(default_factory=list)
    aux_owned: list[int] = field(default_factory=list)
    aux_reserved: int = 0
    shared_prefix: int = 0  # prompt tokens likely shared with other requests (a chat's system part), 0: unknown

    @property
    def prompt_len(self) -> int:
        return len(self.prompt_ids)

    # The properties below are read for every row of every step: each is written out in
    # fields rather than through the others, which would cost a call per level.
    @property
    def prefill_target(self) -> int:
        """Positions that go through prefill: all but the last prompt token."""
        return len(self.prompt_ids) - 1

    @property
    def prefill_done(self) -> bool:
        return self.prefilled >= len(self.prompt_ids) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def wants_decode(self) -> bool:
        return (
            self.prefilled >= len(self.prompt_ids) - 1  # prefill_done
            and self.finish_reason is None
            and self.decodes_launched < self.max_new
        )


def row_sampling(req: Request, eos_ids: frozenset[int]) -> RowSampling:
    """What the worker needs to choose ``req``'s tokens in its row (sent once, at admission)."""
    p = req.params
    stop_ids = set(p.stop_token_ids) | (set() if p.ignore_eos else set(eos_ids))
    return RowSampling(
        row=req.row, temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
        repetition_penalty=p.repetition_penalty, presence_penalty=p.presence_penalty,
        frequency_penalty=p.frequency_penalty, logit_bias=list(p.logit_bias),
        seed=p.seed if p.seed is not None else 0,
        stop_ids=sorted(stop_ids) if p.min_tokens else [], logprobs=p.logprobs, top_logprobs=p.top_logprobs,
    )
