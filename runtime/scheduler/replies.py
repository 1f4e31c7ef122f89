"""What a request's replies say: streamed text deltas (stop strings held back), final results."""

from __future__ import annotations

from runtime.protocol import client as cp
from runtime.scheduler.request import Request
from runtime.scheduler.step_results import StepOutput
from runtime.scheduler.tokenizer import Tokenizer


def text_delta(out: StepOutput) -> tuple[str, str | None]:
    """The new text a step's tokens completed for their request, and the stop string they matched.

    Requests without a detokenizer (non-streaming, no stop strings) decode once, at the end.
    Text that may still begin a stop string is held back; matched text is never returned.
    """
    req = out.req
    if req.detok is None:
        return "", None
    stop_token = out.finished and req.ended_by_token  # EOS or a stop token: not text
    delta = "" if stop_token else req.detok.add(out.new_ids)
    if out.finished:
        delta += req.detok.flush()
    matched = None
    if req.stop_matcher is not None:
        delta, matched = req.stop_matcher.feed(delta)
        if matched is None and out.finished:
            delta += req.stop_matcher.flush()
        req.text += delta
    return delta, matched


def done_message(req: Request, rid: str, tokenizer: Tokenizer) -> cp.Done:
    """The final result of ``req`` under the client's own ``rid``."""
    if req.stop_matcher is not None:
        text = req.text
    elif req.detok is not None:
        text = req.detok.text
    else:
        ids = req.output_ids[:-1] if req.ended_by_token else req.output_ids  # a stop token is not text
        text = tokenizer.decode(ids) if ids else ""
    return cp.Done(
        rid=rid,
        finish_reason=req.finish_reason or "error",
        token_ids=req.output_ids,
        text=text,
        prompt_tokens=req.prompt_len,
        cached_tokens=req.prefix_len,
        error=req.error,
        logprobs=wire_logprobs(req.logprobs) if req.params.logprobs else None,
        stop_reason=req.stop_reason,
        queue_s=req.admitted_at - req.arrived_at if req.admitted_at else None,
        prompt_ids=req.prompt_ids if req.params.prompt_logprobs >= 0 else None,
        prompt_logprobs=wire_logprobs(req.prompt_logprobs) if req.params.prompt_logprobs >= 0 else None,
    )


def wire_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]]) -> list[cp.TokenLogprob]:
    return [cp.TokenLogprob(token_id=t, logprob=lp, top=top) for t, lp, top in entries]
