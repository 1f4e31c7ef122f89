"""The bench's streaming HTTP load client: one POST per connection, events handled per read.

A load generator must cost less than the service it measures. ``httpx`` spends about 200 us
of Python per network read of a streamed response (its HTTP/1.1 state machine, the anyio
stream, async generator layers), five times the ZMQ client's cost per token, and on a host
where the worker is bound by its own CPU the difference showed up as the gateway's. This
client writes the request itself and hands the caller the whole events of each read as raw
bytes, to count with ``choice_events`` / ``choice_and_text_events``; it parses JSON only for the events
that end a stream (usage) or fail it. It speaks just enough HTTP for that: ``Connection:
close``, a status line, headers, and a body read to EOF (chunk-size lines sit between events,
so they never split one). Both the runtime's gateway (compact JSON) and ``mlx_lm.server``
(``json.dumps``'s ", " and ": ") are read.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from urllib.parse import urlsplit

# JSON strings escape their quotes, so these only ever match the chunks' own keys.
_CHOICE = re.compile(rb'"choices": ?\[\{')
_EMPTY_TEXT = re.compile(rb'"text": ?""')
_USAGE = re.compile(rb'"usage": ?\{')
_ERROR = re.compile(rb'"error": ?[\{"]')
_FINISH = re.compile(rb'"finish_reason": ?"(\w+)"')


def choice_events(events: bytes) -> int:
    """Chunk events in ``events`` that carry a choice."""
    return len(_CHOICE.findall(events))


def choice_and_text_events(events: bytes) -> tuple[int, int]:
    """(choice events in ``events``, those of them whose text is not empty: a completion's chunks)."""
    choices = choice_events(events)
    return choices, choices - len(_EMPTY_TEXT.findall(events)) if choices else 0


class HttpStreamError(RuntimeError):
    """The gateway answered with an error status or an error event."""


def request_bytes(url: str, path: str, body: dict) -> tuple[str, int, bytes]:
    """(host, port, the request's bytes) of a JSON POST to ``url`` + ``path``."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    payload = json.dumps(body).encode()
    head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\nConnection: close\r\n\r\n")
    return host, port, head.encode() + payload


def last_finish_reason(events: bytes) -> str | None:
    """The last non-null ``finish_reason`` in ``events`` (None where they carry none)."""
    found = _FINISH.findall(events)
    return found[-1].decode() if found else None


def _last_event_with(data: bytes, key: re.Pattern) -> dict | None:
    """The JSON of the last ``data: {...}`` line of ``data`` that matches ``key``."""
    found = None
    for found in key.finditer(data):
        pass
    if found is None:
        return None
    begin = data.rfind(b"data: {", 0, found.start())
    end = data.find(b"\n", found.start())
    return json.loads(data[begin + 6:end if end >= 0 else len(data)]) if begin >= 0 else None


async def stream(url: str, path: str, body: dict, on_events: Callable[[float, bytes], None],
                 timeout_s: float = 600.0) -> dict | None:
    """POST ``body``; call ``on_events(arrival time, whole events)`` for every read that
    completes events, and return the stream's usage object (None without one). Raises
    HttpStreamError on an error status or an error event."""
    host, port, request = request_bytes(url, path, body)
    reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            rest = await asyncio.wait_for(reader.read(), timeout_s)
            raise HttpStreamError(f"HTTP {status}: {rest[-2000:].decode(errors='replace')}")
        pending = b""
        tail = b""  # the last events, for the usage event at the end
        while True:
            block = await asyncio.wait_for(reader.read(1 << 16), timeout_s)
            if not block:
                break
            now = time.perf_counter()
            data = pending + block
            cut = data.rfind(b"\n\n")  # only whole events are handed on; the rest waits for more
            if cut < 0:
                pending = data
                continue
            events, pending = data[:cut + 2], data[cut + 2:]
            if _ERROR.search(events):
                error = _last_event_with(events, _ERROR)
                if error is not None and error.get("error"):
                    raise HttpStreamError(f"HTTP stream error: {error['error']}")
            on_events(now, events)
            tail = (tail + events)[-8192:]
        usage = _last_event_with(tail, _USAGE)
        return usage.get("usage") if usage else None
    finally:
        writer.close()
