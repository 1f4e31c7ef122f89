"""Server-sent events for ``stream=true``: OpenAI's chunk objects, then ``data: [DONE]``.

``FanoutResponse`` closes the request's ``Fanout`` however the response ends (finished,
failed, or the HTTP client gone), so the scheduler aborts what is still running.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.client import GenerationResult, TokenLogprob
from runtime.gateway.convert import finish_reason, usage
from runtime.gateway.errors import failure
from runtime.gateway.fanout import ChoiceEvent, Fanout

LogprobsFormat = Callable[[list[TokenLogprob] | None, int], dict | None]
"""(entries, text offset) -> the endpoint's logprobs object."""

ChoiceBody = Callable[[int, str, "dict | None", "str | None"], "dict | None"]
"""(index, text, logprobs, finish_reason) -> one choice of a chunk, or None for nothing to send yet."""


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


class FanoutResponse(StreamingResponse):
    """A streaming response that always closes its fanout when the response ends."""

    def __init__(self, content: AsyncIterator[str], fanout: Fanout) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._fanout = fanout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._fanout.close()


class _Choice:
    """What one choice has streamed so far (text and logprob count), to send only the rest at its end."""

    def __init__(self) -> None:
        self.text = ""
        self.logprobs = 0


async def stream_events(
    first: ChoiceEvent,
    fanout: Fanout,
    *,
    count: int,
    per_prompt: int,
    envelope: dict,
    choice_body: ChoiceBody,
    logprobs_format: LogprobsFormat,
    include_usage: bool,
    opening: Sequence[dict] = (),
) -> AsyncIterator[str]:
    """Chunks of every choice in arrival order; ``choice_body(index, text, logprobs, finish)``
    builds one choice of a chunk, ``opening`` are choices sent first (the chat role deltas)."""
    extra = {"usage": None} if include_usage else {}
    choices = [_Choice() for _ in range(count)]
    results: list[GenerationResult | None] = [None] * count
    if opening:
        yield sse(envelope | {"choices": list(opening)} | extra)
    event: ChoiceEvent | None = first
    while event is not None:
        if event.error is not None:
            yield sse(failure(event.error).body())
            break
        state = choices[event.index]
        if event.chunk is not None:
            chunk = event.chunk
            logprobs = logprobs_format(chunk.logprobs, len(state.text)) if chunk.logprobs is not None else None
            state.logprobs += len(chunk.logprobs or ())
            state.text += chunk.text
            body = choice_body(event.index, chunk.text, logprobs, None) if chunk.text or logprobs else None
            if body is not None:
                yield sse(envelope | {"choices": [body]} | extra)
        else:
            result = event.result
            assert result is not None
            results[event.index] = result
            rest = result.text[len(state.text):] if result.text.startswith(state.text) else ""
            rest_logprobs = result.logprobs[state.logprobs:] if result.logprobs is not None else None
            logprobs = logprobs_format(rest_logprobs, len(state.text)) if rest_logprobs else None
            body = choice_body(event.index, rest, logprobs, finish_reason(result))
            yield sse(envelope | {"choices": [body]} | extra)
        event = await fanout.next_event()
    else:
        if include_usage:
            done = [r for r in results if r is not None]
            yield sse(envelope | {"choices": [], "usage": usage(done, per_prompt)})
    yield sse("[DONE]")
