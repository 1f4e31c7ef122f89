"""Server-sent event frames of one streamed response, encoded as bytes with msgspec.

Every chunk of a response repeats the same envelope (``id``, ``object``, ``created``,
``model``) and the same ``usage`` slot; it is encoded once, so a chunk costs one encode of
its choices. The framing is SSE's ``data: ...`` and a blank line.
"""

from __future__ import annotations

import msgspec

DONE = b"data: [DONE]\n\n"

_encode = msgspec.json.Encoder().encode


def event(obj: dict) -> bytes:
    """One ``data:`` event of a whole object (an error, the usage chunk)."""
    return b"data: " + _encode(obj) + b"\n\n"


class ChunkFrames:
    """Frames of chunk objects ``envelope | {"choices": [...]}`` (plus ``"usage": null`` when
    the stream ends with a usage chunk), keys in that order."""

    def __init__(self, envelope: dict, include_usage: bool) -> None:
        head = _encode(envelope)
        assert head.endswith(b"}") and len(head) > 2, "the envelope is a non-empty object"
        self._head = b"data: " + head[:-1] + b',"choices":['
        self._tail = b'],"usage":null}\n\n' if include_usage else b"]}\n\n"

    def chunk(self, choice: dict) -> bytes:
        """The frame of a chunk with one choice."""
        return self._head + _encode(choice) + self._tail

    def chunk_of(self, choices: list[dict]) -> bytes:
        """The frame of a chunk with several choices (the chat role deltas)."""
        return self._head + b",".join(_encode(c) for c in choices) + self._tail

    def usage_chunk(self, usage: dict) -> bytes:
        """The last chunk of ``stream_options.include_usage``: no choices, the usage."""
        return self._head + b'],"usage":' + _encode(usage) + b"}\n\n"
