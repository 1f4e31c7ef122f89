"""The bench's light SSE load client against a hand-fed HTTP/1.1 server (chunked, split reads)."""

from __future__ import annotations

import asyncio
import json

import pytest

from runtime.bench import sse_load
from runtime.bench.measure import StreamTiming


def _chunked(frames: list[bytes]) -> bytes:
    return b"".join(f"{len(f):x}\r\n".encode() + f + b"\r\n" for f in frames) + b"0\r\n\r\n"


def _frame(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


async def _serve(status: int, body: bytes, split: int):
    """A server that answers one request with ``body`` written ``split`` bytes at a time."""
    seen: list[bytes] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = int(next(line for line in head.split(b"\r\n") if line.lower().startswith(b"content-length"))
                     .split(b":")[1])
        seen.append(await reader.readexactly(length))
        writer.write(f"HTTP/1.1 {status} X\r\ncontent-type: text/event-stream\r\n"
                     "transfer-encoding: chunked\r\n\r\n".encode())
        for i in range(0, len(body), split):
            writer.write(body[i:i + split])
            await writer.drain()
            await asyncio.sleep(0.001)
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", seen


@pytest.mark.parametrize("split", [1, 7, 4096])
def test_counts_choice_events_and_reads_usage(split):
    frames = [_frame({"id": "x", "choices": [{"index": 0, "text": t}]}) for t in ['a', '"choices":[{', 'b\n\nc']]
    frames.append(_frame({"id": "x", "choices": [], "usage": {"completion_tokens": 5}}) + b"data: [DONE]\n\n")

    async def run():
        server, url, seen = await _serve(200, _chunked(frames), split)
        async with server:
            timing = StreamTiming(start=0.0)
            usage = await sse_load.stream(url, "/v1/completions", {"prompt": [1, 2]},
                                          lambda now, events: timing.add([0] * sse_load.choice_events(events), at=now))
        return timing, usage, seen

    timing, usage, seen = asyncio.run(run())
    assert usage == {"completion_tokens": 5}
    assert timing.n_tokens == 3  # three choice events, whatever the text inside them holds
    assert json.loads(seen[0]) == {"prompt": [1, 2]}


def test_error_status_and_error_event_raise():
    async def run(status: int, body: bytes):
        server, url, _ = await _serve(status, body, 64)
        async with server:
            await sse_load.stream(url, "/v1/completions", {}, lambda now, events: None)

    with pytest.raises(sse_load.HttpStreamError, match="HTTP 400"):
        asyncio.run(run(400, _chunked([b'{"error":{"message":"bad"}}'])))
    with pytest.raises(sse_load.HttpStreamError, match="worker died"):
        asyncio.run(run(200, _chunked([_frame({"error": {"message": "worker died"}})])))


def test_counts_text_events_in_either_json_spacing():
    # The gateway's compact JSON and mlx_lm.server's json.dumps spacing; an empty text is no token.
    compact = b'data: {"choices":[{"text":"a"}]}\n\ndata: {"choices":[{"text":""}]}\n\n'
    spaced = b'data: {"choices": [{"text": "a"}]}\n\ndata: {"choices": [{"text": ""}]}\n\n: keepalive\n\n'
    for events in (compact, spaced):
        assert sse_load.choice_events(events) == 2 and sse_load.choice_and_text_events(events) == (2, 1)
