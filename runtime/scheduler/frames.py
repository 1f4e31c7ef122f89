"""The frame layouts a ROUTER socket receives, and what each becomes."""

from __future__ import annotations

from dataclasses import dataclass

import msgspec

from runtime.protocol import client as cp
from runtime.protocol.client import MAX_RID_LEN


@dataclass(frozen=True)
class Incoming:
    """A client message: who sent it, the envelope to send back (REQ), and its one payload frame."""

    identity: bytes
    envelope: tuple[bytes, ...]
    payload: bytes


class BadFrames(ValueError):
    """A layout that is neither DEALER's [payload] nor REQ's [..., b"", payload]."""


def split_frames(frames: list[bytes]) -> Incoming:
    """``[identity, payload]`` (DEALER) or ``[identity, *hops, b"", payload]`` (REQ, possibly proxied).

    Raises BadFrames for anything else; the message says what was expected.
    """
    if len(frames) < 2:
        raise BadFrames("empty message")
    identity = frames[0]
    if len(frames) == 2:
        return Incoming(identity, (), frames[1])
    if frames[-2] == b"":
        return Incoming(identity, tuple(frames[1:-1]), frames[-1])
    raise BadFrames(
        f"expected one frame (a DEALER socket) or an empty delimiter and one frame (a REQ socket); "
        f"got {len(frames) - 1} frames"
    )


class _RidOnly(msgspec.Struct):
    rid: str = ""


_rid_decoder = msgspec.msgpack.Decoder(_RidOnly)


def guess_rid(payload: bytes) -> str:
    """The rid of a message that failed to decode, when it has a short string one (else "")."""
    try:
        rid = _rid_decoder.decode(payload).rid
    except Exception:
        return ""
    return rid if len(rid) <= MAX_RID_LEN else ""


def read_message(frames: list[bytes]) -> tuple[bytes, tuple[bytes, ...], msgspec.Struct]:
    """(identity, envelope, message) of a client's frames; for frames that hold no client
    message, the message is the ``ProtocolError`` to answer with."""
    try:
        incoming = split_frames(frames)
    except BadFrames as exc:
        return frames[0], (), cp.ProtocolError(rid="", message=str(exc))
    try:
        msg = cp.client_msg_decoder.decode(incoming.payload)
    except Exception as exc:  # DecodeError, ValidationError, RecursionError: any payload at all
        msg = cp.ProtocolError(rid=guess_rid(incoming.payload), message=f"malformed message: {exc}")
    return incoming.identity, incoming.envelope, msg
