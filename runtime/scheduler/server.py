"""The scheduler process: client socket, worker socket, and the step loop between them.

No client message can end it: every frame layout and payload gets an error reply or is
dropped. Requests belong to the connection that sent them (``Peer``); a connection that
goes away (found by ROUTER_MANDATORY sends and periodic pings) or stops reading has its
requests aborted. A dead or hung worker is replaced (``WorkerSupervisor``).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import secrets
import time

import msgspec
import zmq

from runtime.config import Config
from runtime.protocol import client as cp
from runtime.protocol import worker as wp
from runtime.protocol.loop_socket import LoopSocket
from runtime.protocol.security import check_bind_allowed, secure_server
from runtime.scheduler.addresses import Addresses, bind_client
from runtime.scheduler.admission import Limits, RequestRejected
from runtime.scheduler.core import Scheduler, StepOutput
from runtime.scheduler.frames import BadFrames, split_frames
from runtime.scheduler.intake import Intake
from runtime.scheduler.params import check_sampling
from runtime.scheduler.peers import Peer, PeerBusy, PeerGone, PeerTable, ReplyTo
from runtime.scheduler.request import Request, SamplingParams
from runtime.scheduler.stop_strings import StopMatcher
from runtime.scheduler.supervisor import WORKER_POLL_S, WorkerStartError, WorkerSupervisor
from runtime.scheduler.tokenizer import Detokenizer, Tokenizer

__all__ = ["Server", "WorkerStartError"]

MAINTENANCE_S = 0.05
PROBE_EVERY = 5  # maintenance ticks between pings to clients with requests (0.25 s)
HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 10000


class _RidOnly(msgspec.Struct):
    rid: str = ""


_rid_decoder = msgspec.msgpack.Decoder(_RidOnly)


class Server:
    """Owns the sockets, the worker supervisor and the Scheduler; all I/O is here."""

    def __init__(self, config: Config, addresses: Addresses) -> None:
        self.config = config
        self.addresses = addresses
        self.ctx = zmq.Context()
        sock = self._client_sock = self.ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # full or departed peers raise instead of dropping
        sock.setsockopt(zmq.MAXMSGSIZE, int(config.server.max_message_mb * 2**20))
        sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)  # vanished TCP hosts drop out
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
        check_bind_allowed(addresses.client, config.server)
        self._auth = secure_server(self.ctx, sock, config.server)
        bind_client(sock, addresses)  # before the model loads: a busy address fails fast
        self.clients: LoopSocket | None = None  # wraps the socket once the loop runs (start)
        self.supervisor = WorkerSupervisor(config, self.ctx, addresses.worker)
        self.tokenizer = Tokenizer(config.model.path)
        self.intake = Intake(self.tokenizer, config.scheduler.max_context or 4096)
        self.peers = PeerTable(self._send_frames, config.server.slow_client_timeout_s)
        self.scheduler: Scheduler | None = None
        self.ready: wp.Ready | None = None
        self.wakeup = asyncio.Event()
        self.last_step: wp.StepDone | None = None
        self.steps_done = 0
        self._ids = itertools.count()
        self._pending_chunks: dict[Peer, list[cp.Chunk]] = {}
        self._tokenizing: set[Request] = set()
        self._lost: list[Peer] = []
        self._tasks: set[asyncio.Task] = set()
        self._ping = cp.client_encoder.encode(cp.Ping())

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    # ---- worker lifecycle ------------------------------------------------------------
    def _new_scheduler(self, ready: wp.Ready) -> Scheduler:
        s, c = self.config.scheduler, self.config.cache
        limits = Limits(
            num_slots=ready.num_slots,
            max_rows=ready.max_rows,
            max_context=ready.max_context,
            vocab_size=ready.vocab_size,
            max_step_tokens=s.max_step_tokens,
            prefill_chunk=s.prefill_chunk,
            cache_enabled=c.enabled,
            aux_slots=ready.aux_slots,
            track_chunk=c.track_chunk,
        )
        self.intake.set_max_context(ready.max_context)
        return Scheduler(limits, self.tokenizer.eos_ids, debug_invariants=s.debug_invariants)

    async def start(self) -> None:
        self.ready = await self.supervisor.start()
        self.scheduler = self._new_scheduler(self.ready)
        self.clients = LoopSocket(self._client_sock)

    async def _recover(self, reason: str) -> None:
        """Fail what ran on the dead worker, restart it, keep the waiting requests."""
        old = self.scheduler
        assert old is not None
        old.fail_all(reason)
        self._send_completed()
        self.ready = await self.supervisor.restart(reason)  # WorkerStartError ends the service
        self.scheduler = self._new_scheduler(self.ready)
        self.scheduler.adopt_waiting(old.waiting)
        self.wakeup.set()

    # ---- client side: sending --------------------------------------------------------
    def _send_frames(self, frames: list[bytes]) -> None:
        assert self.clients is not None
        try:
            self.clients.send_multipart(frames)
        except zmq.Again:
            raise PeerBusy from None
        except zmq.ZMQError as exc:
            if exc.errno == zmq.EHOSTUNREACH:
                raise PeerGone from None
            raise

    def _reply(self, to: ReplyTo, msg: msgspec.Struct) -> None:
        try:
            self.peers.send(to.peer, [*to.envelope, cp.client_encoder.encode(msg)], time.monotonic())
        except PeerGone:
            self._lost.append(to.peer)  # its requests are aborted by the maintenance loop

    def _reply_raw(self, identity: bytes, envelope: tuple[bytes, ...], msg: msgspec.Struct) -> None:
        """A reply outside any request (protocol errors, status): sent now or dropped."""
        try:
            self._send_frames([identity, *envelope, cp.client_encoder.encode(msg)])
        except (PeerBusy, PeerGone):
            pass

    def _forget(self, req: Request) -> None:
        to: ReplyTo | None = req.client
        if to is not None and to.peer.requests.get(to.rid) is req:
            del to.peer.requests[to.rid]
            self.peers.forget_if_idle(to.peer)

    def _reply_done(self, req: Request) -> None:
        to: ReplyTo | None = req.client
        if to is None:
            return
        self._forget(req)
        if to.peer.gone:
            return
        if req.stop_matcher is not None:
            text = req.text
        elif req.detok is not None:
            text = req.detok.text
        else:
            ids = req.output_ids[:-1] if req.finish_reason == "stop" else req.output_ids  # a stop token is not text
            text = self.tokenizer.decode(ids) if ids else ""
        done = cp.Done(
            rid=to.rid,
            finish_reason=req.finish_reason or "error",
            token_ids=req.output_ids,
            text=text,
            prompt_tokens=req.prompt_len,
            cached_tokens=req.prefix_len,
            error=req.error,
            logprobs=_wire_logprobs(req.logprobs) if req.params.logprobs else None,
            stop_reason=req.stop_reason,
        )
        self._reply(to, done)

    def _abort_peer(self, peer: Peer) -> None:
        """The client went away or stopped reading: end every request it has."""
        for req in list(peer.requests.values()):
            if req in self._tokenizing or self.scheduler is None:
                req.finish_reason = "abort"
            else:
                self.scheduler.finish(req, "abort")
        peer.requests.clear()

    # ---- client side: receiving ------------------------------------------------------
    async def client_loop(self) -> None:
        assert self.clients is not None
        while True:
            frames = await self.clients.recv_multipart()
            assert frames is not None  # no timeout: only a message ends the wait
            try:
                self._on_frames(frames)
            except Exception as exc:  # a bug must cost one message, never the service
                print(f"runtime: error handling a client message: {exc!r}", flush=True)

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            incoming = split_frames(frames)
        except BadFrames as exc:
            self._reply_raw(frames[0], (), cp.ProtocolError(rid="", message=str(exc)))
            return
        try:
            msg = cp.client_msg_decoder.decode(incoming.payload)
        except Exception as exc:  # DecodeError, ValidationError, RecursionError: any payload at all
            rid = _guess_rid(incoming.payload)
            self._reply_raw(incoming.identity, incoming.envelope, cp.ProtocolError(rid=rid, message=f"malformed message: {exc}"))
            return
        if isinstance(msg, cp.Generate):
            self._on_generate(incoming.identity, incoming.envelope, msg)
        elif isinstance(msg, cp.Abort):
            self._on_abort(incoming.identity, incoming.envelope, msg)
        elif isinstance(msg, cp.StatusQuery):
            self._reply_raw(incoming.identity, incoming.envelope, self._status(msg.rid))

    def _on_generate(self, identity: bytes, envelope: tuple[bytes, ...], msg: cp.Generate) -> None:
        s = self.scheduler
        assert s is not None
        peer = self.peers.get(identity)
        to = ReplyTo(peer, envelope, msg.rid)

        def reject(error: str) -> None:
            self._reply(to, cp.Done(rid=msg.rid, finish_reason="error", error=error))
            self.peers.forget_if_idle(peer)

        if msg.rid in peer.requests:
            return reject(f"request id {msg.rid!r} is already in use on this connection")
        if self.supervisor.state != "up":
            return reject(f"worker unavailable, retrying ({self.supervisor.down_reason}); send the request again shortly")
        queued = len(s.waiting) + len(self._tokenizing)
        if queued >= self.config.scheduler.max_waiting:
            return reject(f"overloaded: {queued} requests are waiting (scheduler.max_waiting); retry later")
        assert self.ready is not None
        try:
            choice = check_sampling(
                temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
                repetition_penalty=msg.repetition_penalty, presence_penalty=msg.presence_penalty,
                frequency_penalty=msg.frequency_penalty, logit_bias=msg.logit_bias, seed=msg.seed,
                min_tokens=msg.min_tokens, stop=msg.stop, logprobs=msg.logprobs, top_logprobs=msg.top_logprobs,
                vocab_size=self.ready.vocab_size,
            )
            if any(not 0 <= t < self.ready.vocab_size for t in msg.stop_token_ids):
                raise RequestRejected(f"stop_token_ids must be token ids in 0..{self.ready.vocab_size - 1}")
        except RequestRejected as exc:
            return reject(str(exc))
        seed = choice.seed if choice.seed is not None else secrets.randbits(64)  # unseeded: random per request
        params = SamplingParams(
            **{**dataclasses.asdict(choice), "seed": seed},
            max_tokens=msg.max_tokens,
            ignore_eos=msg.ignore_eos,
            stop_token_ids=frozenset(msg.stop_token_ids),
        )
        req = Request(rid=f"r{next(self._ids)}", prompt_ids=[], params=params, max_new=0)
        req.stream = msg.stream and not envelope  # a REQ socket takes one reply per request
        req.client = to
        req.arrived_at = time.monotonic()
        peer.requests[msg.rid] = req
        if envelope:
            peer.pingable = False
        if not self.intake.needs_thread(msg):
            try:
                ids = self.intake.prompt_ids_now(msg)
            except RequestRejected as exc:
                return self._fail_new(req, str(exc))
            return self._admit(req, msg, ids)
        self._tokenizing.add(req)
        task = asyncio.create_task(self._tokenize_then_admit(req, msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _tokenize_then_admit(self, req: Request, msg: cp.Generate) -> None:
        try:
            ids = await self.intake.prompt_ids(msg)
        except RequestRejected as exc:
            if not req.finished:
                self._fail_new(req, str(exc))
            return
        finally:
            self._tokenizing.discard(req)
        if not req.finished:  # else aborted, or its client left, while tokenizing: answered already
            self._admit(req, msg, ids)

    def _fail_new(self, req: Request, error: str) -> None:
        req.finish_reason, req.error = "error", error
        self._reply_done(req)

    def _admit(self, req: Request, msg: cp.Generate, ids: list[int]) -> None:
        assert self.scheduler is not None
        try:
            req.max_new = self.scheduler.validate(ids, msg.max_tokens, req.params.temperature)
        except RequestRejected as exc:
            return self._fail_new(req, str(exc))
        req.prompt_ids = ids
        if req.params.stop:
            req.stop_matcher = StopMatcher(list(req.params.stop))
        if req.stream or req.stop_matcher is not None:
            req.detok = Detokenizer(self.tokenizer)  # other requests decode once, at the end
        self.scheduler.add(req)
        self.wakeup.set()

    def _on_abort(self, identity: bytes, envelope: tuple[bytes, ...], msg: cp.Abort) -> None:
        peer = self.peers.peers.get(identity)
        req = peer.requests.get(msg.rid) if peer is not None else None
        found = req is not None and not req.finished
        self._reply_raw(identity, envelope, cp.AbortReply(rid=msg.rid, found=found))
        if not found:
            return
        assert req is not None and self.scheduler is not None
        if req in self._tokenizing:
            req.finish_reason = "abort"
            self._reply_done(req)
        else:
            self.scheduler.abort(req.rid)
            self._send_completed()

    def _status(self, rid: str) -> cp.StatusReply:
        s = self.scheduler
        assert s is not None and self.ready is not None
        return cp.StatusReply(
            rid=rid,
            model=self.config.model.path,
            model_type=self.ready.model_type,
            waiting=len(s.waiting) + len(self._tokenizing),
            running=len(s.running),
            kv_slots_total=s.slots.capacity,
            kv_slots_free=s.slots.free_count,
            kv_slots_cached=s.tree.total_size if s.tree is not None else 0,
            worker_restarts=self.restarts,
            max_context=self.ready.max_context,
            worker_pid=self.supervisor.pid,
            aux_slots_total=s.aux.slots.capacity if s.aux is not None else 0,
            aux_slots_free=s.aux.slots.free_count if s.aux is not None else 0,
            aux_slots_cached=len(s.tree.owned_aux_slots()) if s.aux is not None and s.tree is not None else 0,
            steps=self.steps_done,
            worker_idle_s=self.last_step.idle_s if self.last_step is not None else 0.0,
            worker_uptime_s=self.last_step.uptime_s if self.last_step is not None else 0.0,
            worker_state=self.supervisor.state,
            max_waiting=self.config.scheduler.max_waiting,
            max_message_bytes=int(self.config.server.max_message_mb * 2**20),
            clients=len(self.peers.peers),
            replies_queued=sum(len(p.outbox) for p in self.peers.backlogged),
        )

    # ---- results to clients ----------------------------------------------------------
    def _emit(self, out: StepOutput) -> None:
        req = out.req
        if req.detok is None:
            return
        stop_token = out.finished and req.finish_reason == "stop"  # EOS or a stop token: not text
        delta = "" if stop_token else req.detok.add(out.new_ids)
        if out.finished:
            delta += req.detok.flush()
        if req.stop_matcher is not None:
            delta, matched = req.stop_matcher.feed(delta)
            if matched is not None:
                req.stop_reason = matched
                assert self.scheduler is not None
                self.scheduler.finish(req, "stop")
            elif out.finished:
                delta += req.stop_matcher.flush()
            req.text += delta
        to: ReplyTo = req.client
        if req.stream and to is not None and not to.peer.gone:
            logprobs = _wire_logprobs(out.logprobs) if out.logprobs is not None else None
            chunk = cp.Chunk(rid=to.rid, token_ids=out.new_ids, text=delta, logprobs=logprobs)
            self._pending_chunks.setdefault(to.peer, []).append(chunk)

    def _send_completed(self) -> None:
        """Final results, only once each request's state is cached and released (SPEC 5.2)."""
        assert self.scheduler is not None
        for req in self.scheduler.pop_completed():
            to: ReplyTo | None = req.client
            if to is not None:
                self._flush_chunks(to.peer)  # its chunks before its result
            self._reply_done(req)

    def _flush_chunks(self, only: Peer | None = None) -> None:
        """Send buffered chunks: one message per client (or just ``only``'s)."""
        targets = [only] if only is not None else list(self._pending_chunks)
        for peer in targets:
            chunks = self._pending_chunks.pop(peer, None)
            if chunks and not peer.gone:
                msg = chunks[0] if len(chunks) == 1 else cp.ChunkBatch(chunks=chunks)
                try:
                    self.peers.send(peer, [cp.client_encoder.encode(msg)], time.monotonic())
                except PeerGone:
                    self._lost.append(peer)

    async def maintenance_loop(self) -> None:
        """Retry unsent replies, ping clients with requests, abort those gone or not reading."""
        for tick in itertools.count():
            await asyncio.sleep(MAINTENANCE_S)
            lost = self.peers.flush(time.monotonic())
            if tick % PROBE_EVERY == 0:
                lost += self.peers.probe(self._ping)
            lost += self._lost
            self._lost = []
            for peer in lost:
                self._abort_peer(peer)
            if lost and self.scheduler is not None:
                self._send_completed()

    # ---- the step loop ---------------------------------------------------------------
    async def step_loop(self) -> None:
        while True:
            s = self.scheduler
            assert s is not None
            if not s.inflight and s.waiting and self.config.scheduler.admit_window_ms:
                # Idle until now: let the rest of a burst arrive and join this step.
                await asyncio.sleep(self.config.scheduler.admit_window_ms / 1000)
            was_idle = not s.inflight
            dead = False
            while len(s.inflight) < s.pipeline_depth:
                planned = s.next_step()
                if planned is None:
                    break
                try:
                    self.supervisor.send(wp.worker_encoder.encode(planned.step))
                except zmq.Again:
                    dead = True  # PAIR refuses sends only when no worker is connected
                    break
            if was_idle and s.inflight:
                self.supervisor.note_progress()  # the step timeout counts from here
            if dead:
                code = self.supervisor.exit_code()
                await self._recover(f"worker died (exit status {code})" if code is not None else "worker disconnected")
                continue
            if not s.inflight:
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), WORKER_POLL_S)
                except asyncio.TimeoutError:
                    pass
                if (code := self.supervisor.exit_code()) is not None:
                    await self._recover(f"worker died (exit status {code})")
                continue
            payload = await self.supervisor.recv(WORKER_POLL_S)
            if payload is None:
                if (code := self.supervisor.exit_code()) is not None:
                    await self._recover(f"worker died (exit status {code})")
                elif self.supervisor.hung(time.monotonic()):
                    timeout = self.config.worker.step_timeout_s
                    await self._recover(f"worker stopped responding (no step for {timeout:g} s)")
                continue
            self.supervisor.note_progress()
            reply = wp.worker_reply_decoder.decode(payload)
            if isinstance(reply, wp.StepDone):
                self.last_step = reply
                self.steps_done += 1
                logprobs = (reply.logprobs, reply.top_ids, reply.top_logprobs) if reply.logprobs else None
                for out in s.on_step_done(reply.step_id, reply.tokens, logprobs):
                    self._emit(out)
                self._send_completed()
                self._flush_chunks()
            elif isinstance(reply, wp.StepFailed):
                s.on_step_failed(reply.step_id, reply.error)
                self._send_completed()

    async def serve_forever(self) -> None:
        tasks = [
            asyncio.create_task(self.client_loop()),
            asyncio.create_task(self.step_loop()),
            asyncio.create_task(self.maintenance_loop()),
        ]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()

    async def shutdown(self) -> None:
        """Fail what is left, stop the worker, close sockets."""
        for task in list(self._tasks):
            task.cancel()
        if self.scheduler is not None and self.clients is not None:
            for req in list(self.scheduler.waiting):  # fail_all covers the running ones
                req.error = "the service is shutting down"
                self.scheduler.finish(req, "error")
            self.scheduler.fail_all("the service is shutting down")
            self._send_completed()
            self.peers.flush(time.monotonic())
        self.supervisor.shutdown()
        self.intake.close()
        if self.clients is not None:
            self.clients.close()
        else:
            self._client_sock.close(0)
        if self._auth is not None:
            self._auth.stop()
        self.ctx.term()


def _wire_logprobs(entries: list[tuple[int, float, list[tuple[int, float]]]]) -> list[cp.TokenLogprob]:
    return [cp.TokenLogprob(token_id=t, logprob=lp, top=top) for t, lp, top in entries]


def _guess_rid(payload: bytes) -> str:
    """The rid of a message that failed to decode, when it has a short string one (else "")."""
    try:
        rid = _rid_decoder.decode(payload).rid
    except Exception:
        return ""
    return rid if len(rid) <= cp.MAX_RID_LEN else ""
