"""Run the choices of one HTTP request (``n`` times each prompt) as client streams, merged.

Every choice is one ``Client.stream`` in its own task; their chunks and results arrive on one
queue in order of production. ``close`` cancels the tasks, and leaving ``async with
client.stream(...)`` aborts a request still running in the scheduler.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from runtime.client import Client, GenerationChunk, GenerationResult, RequestFailed
from runtime.gateway.metrics import Metrics


@dataclass
class ChoiceEvent:
    """One step of choice ``index``: a chunk, its final result, or the exception that ended it."""

    index: int
    chunk: GenerationChunk | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None


class Fanout:
    """The running choices of one request; iterate ``events()``, then always ``await close()``."""

    def __init__(self, client: Client, requests: list[dict], metrics: Metrics) -> None:
        self._queue: asyncio.Queue[ChoiceEvent] = asyncio.Queue()
        self._metrics = metrics
        self._start = time.monotonic()
        self._tasks = [asyncio.create_task(self._run(client, i, kwargs)) for i, kwargs in enumerate(requests)]
        self._pending = len(requests)

    async def _run(self, client: Client, index: int, kwargs: dict) -> None:
        last = None
        try:
            async with client.stream(**kwargs) as stream:
                async for chunk in stream:
                    now = time.monotonic()
                    if last is None:
                        self._metrics.record_first_token(now - self._start)
                    else:
                        self._metrics.record_tokens(len(chunk.token_ids), now - last)
                    last = now
                    self._queue.put_nowait(ChoiceEvent(index, chunk=chunk))
                result = stream.result
            assert result is not None
            self._finished(result)
            self._queue.put_nowait(ChoiceEvent(index, result=result))
        except RequestFailed as exc:
            self._finished(exc.result)
            self._queue.put_nowait(ChoiceEvent(index, error=exc))
        except Exception as exc:  # ServiceUnavailable and the like: this choice fails, the gateway goes on
            self._queue.put_nowait(ChoiceEvent(index, error=exc))

    def _finished(self, result: GenerationResult) -> None:
        self._metrics.record_finish(result.finish_reason, time.monotonic() - self._start, result.prompt_tokens,
                                    result.cached_tokens, len(result.token_ids))

    async def next_event(self) -> ChoiceEvent | None:
        """The next event, or None when every choice has ended."""
        if not self._pending:
            return None
        event = await self._queue.get()
        if event.chunk is None:
            self._pending -= 1
        return event

    async def collect(self) -> list[GenerationResult]:
        """Wait for every choice; raises the first choice's exception if one failed."""
        results: list[GenerationResult | None] = [None] * len(self._tasks)
        while (event := await self.next_event()) is not None:
            if event.error is not None:
                raise event.error
            if event.result is not None:
                results[event.index] = event.result
        return [r for r in results if r is not None]

    async def close(self) -> None:
        """Cancel every choice still running (their scheduler requests are aborted)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
