"""The bench's streaming HTTP load client: one POST per connection, events counted per read.

A load generator must cost less than the service it measures. ``httpx`` spends about 200 us
of Python per network read of a streamed response (its HTTP/1.1 state machine, the anyio
stream, async generator layers), five times the ZMQ client's cost per token, and on a host
where the worker is bound by its own CPU the difference showed up as the gateway's. This
client writes the request itself and only counts, in the raw bytes of each read, the events
that carry a choice; it parses JSON only for the events that end a stream (usage) or fail it.
It speaks just enough HTTP/1.1 for that: ``Connection: close``, a status line, headers, and a
body read to EOF (chunk-size lines sit between events, so they never split one).
"""

from __future__ import annotations

import asyncio
import json
import time
from urllib.parse import urlsplit

from runtime.bench.measure import StreamTiming

_CHOICE = b'"choices":[{'  # JSON strings escape their quotes: only ever a chunk's own key


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


def _last_event_with(data: bytes, key: bytes) -> dict | None:
    """The JSON of the last ``data: {...}`` line of ``data`` that contains ``key``."""
    at = data.rfind(key)
    if at < 0:
        return None
    begin = data.rfind(b"data: {", 0, at)
    end = data.find(b"\n", at)
    return json.loads(data[begin + 6:end if end >= 0 else len(data)]) if begin >= 0 else None


async def stream(url: str, path: str, body: dict, timing: StreamTiming, timeout_s: float = 600.0) -> int:
    """POST ``body`` and stamp each choice event on ``timing`` when its read arrives; returns
    the usage's ``completion_tokens`` (0 without a usage event)."""
    host, port, request = request_bytes(url, path, body)
    reader, writer = await asyncio.open_connection(host, port)
    try:
        writer.write(request)
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout_s)
        status = int(head.split(b" ", 2)[1])
        if status != 200:
            rest = await asyncio.wait_for(reader.read(), timeout_s)
            raise HttpStreamError(f"HTTP {status}: {rest[-2000:].decode(errors='replace')}")
        pending = b""
        tail = b""  # the last events, for the usage (or error) event at the end
        while True:
            block = await asyncio.wait_for(reader.read(1 << 16), timeout_s)
            if not block:
                break
            now = time.perf_counter()
            data = pending + block
            cut = data.rfind(b"\n\n")  # only whole events are counted; the rest waits for more
            if cut < 0:
                pending = data
                continue
            events, pending = data[:cut + 2], data[cut + 2:]
            timing.add([0] * events.count(_CHOICE), at=now)
            if b'"error"' in events:
                error = _last_event_with(events, b'"error"')
                if error is not None and "error" in error:
                    raise HttpStreamError(f"HTTP stream error: {error['error']}")
            tail = (tail + events)[-8192:]
        usage = _last_event_with(tail, b'"usage":{')
        return int(usage["usage"]["completion_tokens"]) if usage else 0
    finally:
        writer.close()
