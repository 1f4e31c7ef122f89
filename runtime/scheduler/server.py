"""The scheduler process: client socket, worker socket, and the step loop between them.

No client message can end it: every frame layout and payload gets an error reply or is
dropped. Requests belong to the connection that sent them (``Peer``); a connection that
goes away (found by ROUTER_MANDATORY sends and periodic pings) or stops reading has its
requests aborted. A dead or hung worker is replaced (``WorkerSupervisor``).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Callable

import msgspec
import zmq

from runtime.config import Config
from runtime.protocol import client as cp
from runtime.protocol import worker as wp
from runtime.protocol.loop_socket import LoopSocket
from runtime.scheduler.addresses import Addresses, open_client_socket
from runtime.scheduler.admission import Limits, RequestRejected
from runtime.scheduler.client_out import ClientOut
from runtime.scheduler.core import Scheduler
from runtime.scheduler.frames import read_message
from runtime.scheduler.grammar import Grammars, grammar_spec
from runtime.scheduler.intake import Intake, sampling_params
from runtime.scheduler.peers import Peer, ReplyTo
from runtime.scheduler.request import Request
from runtime.scheduler.startup_hold import StartupHold
from runtime.scheduler.status import status_reply
from runtime.scheduler.stop_strings import StopMatcher
from runtime.scheduler.supervisor import (
    WORKER_POLL_S,
    WorkerStartError,
    WorkerSupervisor,
)
from runtime.scheduler.tokenizer import Detokenizer, Tokenizer

__all__ = ["Server", "WorkerStartError"]

MAINTENANCE_S = 0.05
PROBE_EVERY = 5  # maintenance ticks between pings to clients with requests (0.25 s)


class Server:
    """Owns the sockets, the worker supervisor and the Scheduler; all I/O is here."""

    def __init__(self, config: Config, addresses: Addresses) -> None:
        self.config = config
        self.addresses = addresses
        self.ctx = zmq.Context()
        # Bound before the model loads: a busy or refused address fails fast.
        self._client_sock, self._auth = open_client_socket(self.ctx, addresses, config.server)
        self.clients: LoopSocket | None = None  # wraps the socket once the loop runs (start)
        self.supervisor = WorkerSupervisor(config, self.ctx, addresses.worker)
        # The worker boots (seconds of imports, model load and warm-up) while this process loads
        # the tokenizer (transformers: seconds too), instead of after it.
        self.supervisor.launch()
        try:
            self.tokenizer = Tokenizer(config.model.path)
        except BaseException:
            self.supervisor.shutdown()
            self._client_sock.close(0)
            if self._auth is not None:
                self._auth.stop()
            self.ctx.term()
            raise
        self.intake = Intake(self.tokenizer, config.scheduler.max_context or 4096)
        self.out = ClientOut(self.tokenizer, config.server.slow_client_timeout_s)
        self.peers = self.out.peers
        self.scheduler: Scheduler | None = None
        self.ready: wp.Ready | None = None
        self.grammars: Grammars | None = None  # structured output, once the vocabulary is known
        self.wakeup = asyncio.Event()
        self.last_step: wp.StepDone | None = None
        self.steps_done = 0
        self._ids = itertools.count()
        self._tokenizing: set[Request] = set()
        self._tasks: set[asyncio.Task] = set()
        self._ping = cp.client_encoder.encode(cp.Ping())

    @property
    def restarts(self) -> int:
        return self.supervisor.restarts

    # ---- worker lifecycle ------------------------------------------------------------
    def _new_scheduler(self, ready: wp.Ready) -> Scheduler:
        limits = Limits.for_worker(ready, self.config)
        self.intake.set_max_context(ready.max_context)
        if self.grammars is None or self.grammars.vocab_size != ready.vocab_size:
            self.grammars = Grammars(self.tokenizer, ready.vocab_size)
        return Scheduler(limits, self.tokenizer.eos_ids, debug_invariants=self.config.scheduler.debug_invariants)

    async def start(self) -> None:
        """Wait for the worker launched in ``__init__``; raises WorkerStartError. Clients are
        read meanwhile: status answers "starting", requests wait for the worker (``StartupHold``)."""
        self.clients = self.out.socket = LoopSocket(self._client_sock)
        hold = StartupHold(self.config, self.out, self.supervisor.pid)
        reading = asyncio.create_task(self._read_clients(hold.on_frames))
        try:
            self.ready = await self.supervisor.wait_ready()
        except BaseException as exc:
            reading.cancel()
            await asyncio.gather(reading, return_exceptions=True)
            hold.fail_all(f"worker unavailable: the worker could not start ({exc})" if isinstance(exc, Exception)
                          else "the service is shutting down")
            raise
        reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
        self.scheduler = self._new_scheduler(self.ready)
        for identity, envelope, msg in hold.take():  # as if they arrived now, in their order
            self._guarded(self._on_message, identity, envelope, msg)

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
        await self._read_clients(self._on_frames)

    async def _read_clients(self, handle: Callable[[list[bytes]], None]) -> None:
        """Hand every client message to ``handle`` (the start-up hold's, then the server's)."""
        assert self.clients is not None
        while True:
            frames = await self.clients.recv_multipart()
            assert frames is not None  # no timeout: only a message ends the wait
            self._guarded(handle, frames)

    @staticmethod
    def _guarded(handle: Callable[..., None], *args: object) -> None:
        try:
            handle(*args)
        except Exception as exc:  # a bug must cost one message, never the service
            print(f"runtime: error handling a client message: {exc!r}", flush=True)

    def _on_frames(self, frames: list[bytes]) -> None:
        identity, envelope, msg = read_message(frames)
        self._on_message(identity, envelope, msg)

    def _on_message(self, identity: bytes, envelope: tuple[bytes, ...], msg: msgspec.Struct) -> None:
        if isinstance(msg, cp.ProtocolError):
            self.out.reply_raw(identity, envelope, msg)
        elif isinstance(msg, cp.Generate):
            try:
                self._on_generate(identity, envelope, msg)
            except Exception as exc:  # a bug: that request fails with the reason, its client never waits
                print(f"runtime: error admitting request {msg.rid!r}: {exc!r}", flush=True)
                peer = self.peers.peers.get(identity)
                if peer is not None:
                    peer.requests.pop(msg.rid, None)
                self.out.reply_raw(identity, envelope,
                                   cp.Done(rid=msg.rid, finish_reason="error", error=f"internal error: {exc!r}"))
        elif isinstance(msg, cp.Abort):
            self._on_abort(identity, envelope, msg)
        elif isinstance(msg, cp.StatusQuery):
            self.out.reply_raw(identity, envelope, self._status(msg.rid))

    def _on_generate(self, identity: bytes, envelope: tuple[bytes, ...], msg: cp.Generate) -> None:
        s = self.scheduler
        assert s is not None
        peer = self.peers.get(identity)
        to = ReplyTo(peer, envelope, msg.rid)

        def reject(error: str) -> None:
            self.out.reply(to, cp.Done(rid=msg.rid, finish_reason="error", error=error))
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
            params = sampling_params(msg, self.ready.vocab_size)
            spec = grammar_spec(msg)
            assert self.grammars is not None
            constraint = self.grammars.constraint(spec) if spec is not None else None
        except RequestRejected as exc:
            return reject(str(exc))
        req = Request(rid=f"r{next(self._ids)}", prompt_ids=[], params=params, max_new=0, constraint=constraint)
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
            if self.scheduler is not None and self.scheduler.aux is not None:
                # a hybrid keeps the state where a chat's system part ends, for the next chats
                req.shared_prefix = await self.intake.shared_prefix(msg, ids)
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
        self.out.reply_done(req)

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
        self.out.reply_raw(identity, envelope, cp.AbortReply(rid=msg.rid, found=found))
        if not found:
            return
        assert req is not None and self.scheduler is not None
        if req in self._tokenizing:
            req.finish_reason = "abort"
            self.out.reply_done(req)
        else:
            self.scheduler.abort(req.rid)
            self._send_completed()

    def _status(self, rid: str) -> cp.StatusReply:
        assert self.scheduler is not None and self.ready is not None
        return status_reply(rid, self.config, self.ready, self.scheduler, self.supervisor, self.peers,
                            tokenizing=len(self._tokenizing), steps=self.steps_done, last_step=self.last_step)

    def _send_completed(self) -> None:
        assert self.scheduler is not None
        self.out.send_completed(self.scheduler)

    async def maintenance_loop(self) -> None:
        """Retry unsent replies, ping clients with requests, abort those gone or not reading."""
        for tick in itertools.count():
            await asyncio.sleep(MAINTENANCE_S)
            lost = self.peers.flush(time.monotonic())
            if tick % PROBE_EVERY == 0:
                lost += self.peers.probe(self._ping)
            lost += self.out.lost
            self.out.lost = []
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
                outputs = s.on_step_done(reply.step_id, reply.tokens, logprobs, reply.prompt_logprobs)
                self._send_masks(s)  # first: the worker may be waiting for them to sample its next step
                for out in outputs:
                    self.out.emit(out, s)
                self._send_completed()
                self.out.flush_chunks()
            elif isinstance(reply, wp.StepFailed):
                s.on_step_failed(reply.step_id, reply.error)
                self._send_masks(s)
                self._send_completed()

    def _send_masks(self, s: Scheduler) -> None:
        """Masks the worker waits for (structured output), ahead of any new step."""
        for masks in s.take_masks():
            try:
                self.supervisor.send(wp.worker_encoder.encode(masks))
            except zmq.Again:
                return  # no worker: the next send of a step finds it dead

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
