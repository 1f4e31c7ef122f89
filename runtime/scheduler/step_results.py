"""A step's records on the scheduler: what was planned, what each request got back, and one
finalized token taken into its request (appended, its logprobs kept, why it ends the request);
prefill chunks' prompt logprobs taken into theirs."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from runtime.protocol.worker import PromptLogprobs, Step
from runtime.scheduler.request import Request


@dataclass
class PlannedStep:
    """A step sent to the worker, with the requests whose tokens it will return."""

    step: Step
    decode_reqs: list[Request]
    prefill_reqs: list[Request] = field(default_factory=list)

    def requests(self) -> list[Request] | set[Request]:
        """Every request the step works for, once (a request decodes at most once per step)."""
        return set(self.decode_reqs) | set(self.prefill_reqs) if self.prefill_reqs else self.decode_reqs


@dataclass
class StepOutput:
    """New tokens for one request after a step, whether it finished, and their logprobs if asked."""

    req: Request
    new_ids: list[int]
    finished: bool
    logprobs: list[tuple[int, float, tuple[tuple[int, float], ...]]] | None = None


def take_token(req: Request, token: int, eos_ids: frozenset[int], logprob: tuple | None) -> str | None:
    """Append ``token`` (with ``logprob``: its (token, logprob, top) entry) to ``req``; the finish
    reason it causes ("stop", "error", "length"), or None. A grammar advances with the token."""
    req.output_ids.append(token)
    if logprob is not None:
        req.logprobs.append(logprob)
    params = req.params
    if token in params.stop_token_ids:
        req.stop_reason, req.ended_by_token = token, True
        return "stop"
    if token in eos_ids and not params.ignore_eos:
        req.ended_by_token = True
        return "stop"
    if req.constraint is not None:
        if (error := req.constraint.advance(token)) is not None:
            req.error = error
            return "error"
        if req.constraint.done:
            return "stop"  # the grammar is complete
    if len(req.output_ids) >= req.max_new:
        return "length"
    return None


def take_prompt_logprobs(by_row: dict[int, Request], chunks: Sequence[PromptLogprobs]) -> None:
    """Append each chunk's prompt logprobs to its request, as (token, logprob, top) entries of
    the prompt tokens after the chunk's (the chunks of a request come in order)."""
    for chunk in chunks:
        req = by_row.get(chunk.row)
        if req is None or req.finished:
            continue
        for i, lp in enumerate(chunk.logprobs):
            top = tuple(zip(chunk.top_ids[i], chunk.top_logprobs[i])) if chunk.top_ids else ()
            req.prompt_logprobs.append((req.prompt_ids[chunk.start + 1 + i], lp, top))
