"""Run the choices of one HTTP request (``n`` times each prompt) as client streams, merged.

A lone choice (the usual request) is read straight from its client stream by whoever awaits
the next event: no task and no queue between the client and the HTTP response. Several
choices each run in a task of their own, and their events arrive on one queue in order of
production. ``close`` aborts whatever is still running in the scheduler.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

from runtime.client import Client, GenerationChunk, GenerationResult, RequestFailed
from runtime.client.client import Stream
from runtime.gateway.errors import failure
from runtime.gateway.metrics import Metrics


@dataclass
class ChoiceEvent:
    """One step of choice ``index``: a chunk, its final result, or the exception that ended it."""

    index: int
    chunk: GenerationChunk | None = None
    result: GenerationResult | None = None
    error: BaseException | None = None

    @property
    def last(self) -> bool:
        """The choice ended with this event."""
        return self.chunk is None


class _ChoiceRun:
    """One choice's client stream as events, its timings recorded as they arrive."""

    def __init__(self, client: Client, index: int, kwargs: dict, metrics: Metrics, start: float) -> None:
        self._client, self._kwargs = client, kwargs
        self._stream: Stream | None = None
        self._index = index
        self._metrics = metrics
        self._start = start
        self._last: float | None = None

    async def next(self) -> ChoiceEvent:
        """The next event; after the one that ends the choice, never called again."""
        try:
            if self._stream is None:  # opened here, so a refusal of its arguments is this choice's error
                self._stream = self._client.stream(**self._kwargs)
            chunk = await self._stream.__anext__()
        except StopAsyncIteration:
            assert self._stream is not None
            result = self._stream.result
            assert result is not None
            self._finished(result)
            return ChoiceEvent(self._index, result=result)
        except RequestFailed as exc:
            self._finished(exc.result)
            return ChoiceEvent(self._index, error=exc)
        except Exception as exc:  # ServiceUnavailable and the like: this choice fails, the gateway goes on
            return ChoiceEvent(self._index, error=exc)
        now = time.monotonic()
        if self._last is None:
            self._metrics.record_first_token(now - self._start)
        else:
            self._metrics.record_tokens(len(chunk.token_ids), now - self._last)
        self._last = now
        return ChoiceEvent(self._index, chunk=chunk)

    def _finished(self, result: GenerationResult) -> None:
        self._metrics.record_finish(result, time.monotonic() - self._start)

    async def close(self) -> None:
        """Abort the request if it still runs."""
        if self._stream is not None:
            await self._stream.aclose()


class Fanout:
    """The running choices of one request; ``next_event`` until None, then always ``await close()``."""

    def __init__(self, client: Client, requests: list[dict], metrics: Metrics) -> None:
        start = time.monotonic()
        self._runs = [_ChoiceRun(client, i, kwargs, metrics, start) for i, kwargs in enumerate(requests)]
        self._pending = len(requests)
        self._queue: asyncio.Queue[ChoiceEvent] | None = None
        self._tasks: list[asyncio.Task] = []
        if len(self._runs) > 1:
            self._queue = asyncio.Queue()
            self._tasks = [asyncio.create_task(self._pump(run)) for run in self._runs]

    async def _pump(self, run: _ChoiceRun) -> None:
        assert self._queue is not None
        try:
            while True:
                event = await run.next()
                self._queue.put_nowait(event)
                if event.last:
                    return
        finally:
            await run.close()

    def _count(self, event: ChoiceEvent) -> ChoiceEvent:
        if event.last:
            self._pending -= 1
        return event

    @property
    def ended(self) -> bool:
        """Every choice has ended (``next_event`` returns None)."""
        return not self._pending

    async def next_event(self) -> ChoiceEvent | None:
        """The next event, or None when every choice has ended."""
        if not self._pending:
            return None
        if self._queue is None:
            return self._count(await self._runs[0].next())
        return self._count(await self._queue.get())

    def ready_event(self) -> ChoiceEvent | None:
        """An event that has already arrived, without waiting; else None."""
        if self._queue is None or self._queue.empty():
            return None
        return self._count(self._queue.get_nowait())

    async def collect(self) -> list[GenerationResult]:
        """Wait for every choice; raises the first choice's exception if one failed."""
        results: list[GenerationResult | None] = [None] * len(self._runs)
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
        if not self._tasks:
            await asyncio.gather(*(run.close() for run in self._runs), return_exceptions=True)


async def results_of(fanout: Fanout) -> list[GenerationResult]:
    """Every choice's result, the fanout closed after; the OpenAI error of the first that failed."""
    try:
        return await fanout.collect()
    except Exception as exc:
        raise failure(exc) from None
    finally:
        await fanout.close()


async def first_event(fanout: Fanout) -> ChoiceEvent:
    """The first event of a response about to stream. When it is an error (the request was
    refused), the fanout is closed and its OpenAI error raised, so the HTTP status says so."""
    try:
        first = await fanout.next_event()
    except BaseException:
        await fanout.close()
        raise
    assert first is not None
    if first.error is not None:
        await fanout.close()
        raise failure(first.error)
    return first
