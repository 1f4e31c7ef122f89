"""Client connections as the scheduler sees them: their requests, their unsent replies.

No sockets here: ``PeerTable`` is given a ``send(frames)`` function that raises
``PeerBusy`` when that client's pipe is full and ``PeerGone`` when it is no longer
connected (ZeroMQ's ROUTER_MANDATORY gives both). Invariants (``check_invariants``):
a peer's outbox is non-empty only while it is in ``backlogged``; a peer in the table has
requests or a backlog; a gone peer holds neither.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from runtime.protocol import client as cp

OUTBOX_MAX_BYTES = 64 * 2**20
"""Unsent replies one client may hold in the scheduler before it counts as not reading."""


class PeerBusy(Exception):
    """The client's pipe is full: it is not reading (yet)."""


class PeerGone(Exception):
    """The client is no longer connected."""


@dataclass(eq=False)
class Peer:
    """One client connection (a ZeroMQ routing id), its requests by the client's own rid."""

    identity: bytes
    requests: dict[str, Any] = field(default_factory=dict)
    outbox: deque[list[bytes]] = field(default_factory=deque)
    outbox_bytes: int = 0
    stalled_since: float | None = None  # when a send last found its pipe full
    gone: bool = False
    pingable: bool = True  # False once it sent a REQ envelope: REQ sockets drop the connection on a ping


@dataclass(frozen=True)
class ReplyTo:
    """Where a request's replies go: its peer, the REQ envelope (empty for DEALER), its client rid."""

    peer: Peer
    envelope: tuple[bytes, ...]
    rid: str


class PeerTable:
    """Every connected client that has requests or unsent replies."""

    def __init__(self, send: Callable[[list[bytes]], None], slow_timeout_s: float) -> None:
        self._send = send
        self.slow_timeout_s = slow_timeout_s
        self.peers: dict[bytes, Peer] = {}
        self.backlogged: set[Peer] = set()
        self._chunks: dict[Peer, list[cp.Chunk]] = {}  # this step's stream chunks, sent as one message per peer

    def queue_chunk(self, peer: Peer, chunk: cp.Chunk) -> None:
        self._chunks.setdefault(peer, []).append(chunk)

    def flush_chunks(self, now: float, only: Peer | None = None) -> list[Peer]:
        """Send queued chunks, one message per peer (or just ``only``'s); return the peers found gone."""
        lost = []
        for peer in [only] if only is not None else list(self._chunks):
            chunks = self._chunks.pop(peer, None)
            if chunks and not peer.gone:
                msg = chunks[0] if len(chunks) == 1 else cp.ChunkBatch(chunks=chunks)
                try:
                    self.send(peer, [cp.client_encoder.encode(msg)], now)
                except PeerGone:
                    lost.append(peer)
        return lost

    def get(self, identity: bytes) -> Peer:
        peer = self.peers.get(identity)
        if peer is None:
            peer = self.peers[identity] = Peer(identity)
        return peer

    def send(self, peer: Peer, frames: list[bytes], now: float) -> None:
        """Send ``frames`` (without the identity) to ``peer`` now or queue them, in order.

        Raises PeerGone when the peer has disconnected; the caller aborts its requests.
        """
        if peer.gone:
            return
        if not peer.outbox:
            try:
                self._send([peer.identity, *frames])
                return
            except PeerBusy:
                peer.stalled_since = now
                self.backlogged.add(peer)
            except PeerGone:
                self.mark_gone(peer)
                raise
        peer.outbox.append(frames)
        peer.outbox_bytes += sum(len(f) for f in frames)

    def flush(self, now: float) -> list[Peer]:
        """Retry every backlog; return the peers found gone or too slow (caller aborts their requests)."""
        lost = []
        for peer in list(self.backlogged):
            try:
                while peer.outbox:
                    self._send([peer.identity, *peer.outbox[0]])
                    frames = peer.outbox.popleft()
                    peer.outbox_bytes -= sum(len(f) for f in frames)
                    peer.stalled_since = now
            except PeerBusy:
                assert peer.stalled_since is not None
                if now - peer.stalled_since > self.slow_timeout_s or peer.outbox_bytes > OUTBOX_MAX_BYTES:
                    self.mark_gone(peer)
                    lost.append(peer)
                continue
            except PeerGone:
                self.mark_gone(peer)
                lost.append(peer)
                continue
            peer.stalled_since = None
            self.backlogged.discard(peer)
            self.forget_if_idle(peer)
        return lost

    def probe(self, ping: bytes) -> list[Peer]:
        """Send ``ping`` to every DEALER-style peer with requests and no backlog; return those found gone.

        REQ peers are never pinged (an unexpected message makes a REQ socket drop the
        connection); one that leaves is found when its reply cannot be sent.
        """
        lost = []
        for peer in list(self.peers.values()):
            if peer.requests and not peer.outbox and peer.pingable:
                try:
                    self._send([peer.identity, ping])
                except PeerBusy:
                    pass  # connected; whether it reads is flush()'s business
                except PeerGone:
                    self.mark_gone(peer)
                    lost.append(peer)
        return lost

    def mark_gone(self, peer: Peer) -> None:
        """Drop the peer's unsent replies; its requests stay listed until the caller aborts them."""
        peer.gone = True
        peer.outbox.clear()
        peer.outbox_bytes = 0
        self.backlogged.discard(peer)
        if self.peers.get(peer.identity) is peer:
            del self.peers[peer.identity]

    def forget_if_idle(self, peer: Peer) -> None:
        if not peer.requests and not peer.outbox and self.peers.get(peer.identity) is peer:
            del self.peers[peer.identity]

    def check_invariants(self) -> None:
        for peer in self.peers.values():
            assert not peer.gone, "a gone peer is still in the table"
            assert peer.requests or peer.outbox, "an idle peer is still in the table"
            assert bool(peer.outbox) == (peer in self.backlogged), "outbox and backlog disagree"
        for peer in self.backlogged:
            assert self.peers.get(peer.identity) is peer
