"""Server-sent events for ``stream=true``: OpenAI's chunk objects, then ``data: [DONE]``.

Events that have already arrived when one is sent (the choices of ``n`` from one step, or a
stream that fell behind) go out together in one write. ``FanoutResponse`` closes the
request's ``Fanout`` however the response ends (finished, failed, or the HTTP client gone),
so the scheduler aborts what is still running.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Sequence

from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from runtime.client import GenerationResult, TokenLogprob
from runtime.gateway import sse
from runtime.gateway.convert import finish_reason, usage
from runtime.gateway.errors import failure
from runtime.gateway.fanout import ChoiceEvent, Fanout

LogprobsFormat = Callable[[list[TokenLogprob] | None, int], dict | None]
"""(entries, text offset) -> the endpoint's logprobs object."""

ChoiceBody = Callable[[int, str, "dict | None", "str | None"], "list[dict]"]
"""(index, text, logprobs, finish_reason) -> the choices to send, one chunk each (none yet: [])."""


class FanoutResponse(StreamingResponse):
    """A streaming response that always closes its fanout when the response ends."""

    def __init__(self, content: AsyncIterator[bytes], fanout: Fanout) -> None:
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"})
        self._fanout = fanout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._fanout.close()


class _Choice:
    """What one choice has streamed so far (its text pieces, their length, the logprob count),
    to send only the rest at its end. Pieces are joined once, at the end: appending to one
    string would copy it for every chunk."""

    def __init__(self) -> None:
        self.pieces: list[str] = []
        self.length = 0
        self.logprobs = 0


class _Frames:
    """The frames of one streamed response's events."""

    def __init__(self, count: int, frames: sse.ChunkFrames, choice_body: ChoiceBody,
                 logprobs_format: LogprobsFormat) -> None:
        self.choices = [_Choice() for _ in range(count)]
        self.results: list[GenerationResult | None] = [None] * count
        self._frames, self._body, self._logprobs = frames, choice_body, logprobs_format

    def of(self, event: ChoiceEvent, out: list[bytes]) -> None:
        """Append the frames of a chunk or result event to ``out``."""
        state = self.choices[event.index]
        if event.chunk is not None:
            chunk = event.chunk
            logprobs = self._logprobs(chunk.logprobs, state.length) if chunk.logprobs is not None else None
            if chunk.logprobs:
                state.logprobs += len(chunk.logprobs)
            if chunk.text:
                state.pieces.append(chunk.text)
                state.length += len(chunk.text)
            bodies = self._body(event.index, chunk.text, logprobs, None) if chunk.text or logprobs else ()
        else:
            result = event.result
            assert result is not None
            self.results[event.index] = result
            sent = "".join(state.pieces)
            rest = result.text[len(sent):] if result.text.startswith(sent) else ""
            rest_logprobs = result.logprobs[state.logprobs:] if result.logprobs is not None else None
            logprobs = self._logprobs(rest_logprobs, state.length) if rest_logprobs else None
            bodies = self._body(event.index, rest, logprobs, finish_reason(result))
        out.extend(self._frames.chunk(body) for body in bodies)


async def stream_events(
    first: ChoiceEvent,
    fanout: Fanout,
    *,
    count: int,
    per_prompt: int,
    frames: sse.ChunkFrames,
    choice_body: ChoiceBody,
    logprobs_format: LogprobsFormat,
    include_usage: bool,
    opening: Sequence[dict] = (),
) -> AsyncIterator[bytes]:
    """Chunks of every choice in arrival order; ``choice_body(index, text, logprobs, finish)``
    builds the choices of a piece, ``opening`` are choices sent first (the chat role deltas)."""
    state = _Frames(count, frames, choice_body, logprobs_format)
    out: list[bytes] = [frames.chunk_of(list(opening))] if opening else []
    event: ChoiceEvent | None = first
    failed = False
    while event is not None:
        if event.error is not None:
            out.append(sse.event(failure(event.error).body()))
            failed = True
            break
        state.of(event, out)
        event = fanout.ready_event()
        if event is None and not fanout.ended:
            if out:
                yield out[0] if len(out) == 1 else b"".join(out)
                out = []
            event = await fanout.next_event()
    if include_usage and not failed:
        out.append(frames.usage_chunk(usage([r for r in state.results if r is not None], per_prompt)))
    out.append(sse.DONE)
    yield b"".join(out)
