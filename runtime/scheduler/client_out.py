"""Everything the scheduler sends to its clients: replies through each connection's bounded
outbox, streamed chunks batched per connection, final results, and the connections found gone."""

from __future__ import annotations

import time

import msgspec
import zmq

from runtime.protocol import client as cp
from runtime.protocol.loop_socket import LoopSocket
from runtime.scheduler.core import Scheduler
from runtime.scheduler.peers import Peer, PeerBusy, PeerGone, PeerTable, ReplyTo
from runtime.scheduler.replies import done_message, text_delta, wire_logprobs
from runtime.scheduler.request import Request
from runtime.scheduler.step_results import StepOutput
from runtime.scheduler.tokenizer import Tokenizer


class ClientOut:
    """The client socket's sending side. ``lost``: connections a send found gone, whose
    requests the server aborts on its next maintenance tick."""

    def __init__(self, tokenizer: Tokenizer, slow_client_timeout_s: float) -> None:
        self.tokenizer = tokenizer
        self.socket: LoopSocket | None = None  # set once the event loop runs
        self.peers = PeerTable(self.send_frames, slow_client_timeout_s)
        self.lost: list[Peer] = []

    def send_frames(self, frames: list[bytes]) -> None:
        assert self.socket is not None
        try:
            self.socket.send_multipart(frames)
        except zmq.Again:
            raise PeerBusy from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerGone from None
            raise

    def reply(self, to: ReplyTo, msg: msgspec.Struct) -> None:
        try:
            self.peers.send(to.peer, [*to.envelope, cp.client_encoder.encode(msg)], time.monotonic())
        except PeerGone:
            self.lost.append(to.peer)

    def reply_raw(self, identity: bytes, envelope: tuple[bytes, ...], msg: msgspec.Struct) -> None:
        """A reply outside any request (protocol errors, status): sent now or dropped."""
        try:
            self.send_frames([identity, *envelope, cp.client_encoder.encode(msg)])
        except (PeerBusy, PeerGone):
            pass

    def forget(self, req: Request) -> None:
        to: ReplyTo | None = req.client
        if to is not None and to.peer.requests.get(to.rid) is req:
            del to.peer.requests[to.rid]
            self.peers.forget_if_idle(to.peer)

    def reply_done(self, req: Request) -> None:
        to: ReplyTo | None = req.client
        if to is None:
            return
        self.forget(req)
        if not to.peer.gone:
            self.reply(to, done_message(req, to.rid, self.tokenizer))

    def emit(self, out: StepOutput, scheduler: Scheduler) -> None:
        """A step's new tokens for one request: a chunk if it streams; a matched stop string ends it."""
        req = out.req
        delta, matched = text_delta(out)
        if matched is not None:
            req.stop_reason = matched
            scheduler.finish(req, "stop")
        to: ReplyTo = req.client
        if req.stream and to is not None and not to.peer.gone:
            logprobs = wire_logprobs(out.logprobs) if out.logprobs is not None else None
            self.peers.queue_chunk(to.peer, cp.Chunk(rid=to.rid, token_ids=out.new_ids, text=delta, logprobs=logprobs))

    def send_completed(self, scheduler: Scheduler) -> None:
        """Final results, only once each request's state is cached and released (SPEC 5.2)."""
        for req in scheduler.pop_completed():
            to: ReplyTo | None = req.client
            if to is not None:
                self.flush_chunks(to.peer)  # its chunks before its result
            self.reply_done(req)

    def flush_chunks(self, only: Peer | None = None) -> None:
        self.lost += self.peers.flush_chunks(time.monotonic(), only)
