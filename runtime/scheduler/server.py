"""The scheduler process: client socket, worker socket, and the step loop between them."""

from __future__ import annotations

import asyncio
import time
import uuid

import msgspec
import zmq

from runtime.config import Config
from runtime.protocol import client as cp
from runtime.protocol import worker as wp
from runtime.protocol.loop_socket import LoopSocket
from runtime.scheduler.addresses import Addresses
from runtime.scheduler.admission import Limits, RequestRejected
from runtime.scheduler.core import Scheduler, StepOutput
from runtime.scheduler.request import Request, SamplingParams
from runtime.scheduler.tokenizer import Detokenizer, Tokenizer
from runtime.scheduler.worker_process import WorkerProcess

WORKER_POLL_S = 0.5


class WorkerStartError(RuntimeError):
    """The worker could not load the model; the message is the loader's."""


class Server:
    """Owns the sockets, the worker process and the Scheduler; all I/O is here."""

    def __init__(self, config: Config, addresses: Addresses) -> None:
        self.config = config
        self.addresses = addresses
        self.ctx = zmq.Context()
        self._client_sock = self.ctx.socket(zmq.ROUTER)
        self._client_sock.setsockopt(zmq.LINGER, 0)
        self.clients: LoopSocket | None = None  # wraps _client_sock once the loop runs (start)
        self.worker_sock: LoopSocket | None = None
        self.worker = WorkerProcess(config, addresses.worker)
        self.tokenizer = Tokenizer(config.model.path)
        self.scheduler: Scheduler | None = None
        self.ready: wp.Ready | None = None
        self.restarts = 0
        self.wakeup = asyncio.Event()
        self.owners: dict[str, bytes] = {}
        self.last_step: wp.StepDone | None = None
        self._outbox: dict[bytes, list[cp.Chunk]] = {}
        self.steps_done = 0

    # ---- worker lifecycle ------------------------------------------------------------
    async def start_worker(self) -> wp.Ready:
        if self.worker_sock is not None:
            self.worker_sock.close()
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.addresses.worker)
        self.worker_sock = LoopSocket(sock)
        self.worker.start()
        deadline = time.monotonic() + self.config.worker.startup_timeout_s
        while time.monotonic() < deadline:
            payload = await self.worker_sock.recv(WORKER_POLL_S)
            if payload is not None:
                reply = wp.worker_reply_decoder.decode(payload)
                if isinstance(reply, wp.LoadFailed):
                    self.worker.stop()
                    raise WorkerStartError(reply.error)
                assert isinstance(reply, wp.Ready)
                return reply
            code = self.worker.exit_code()
            if code is not None:
                raise WorkerStartError(f"worker exited with status {code} while loading the model")
        self.worker.stop()
        raise WorkerStartError(f"worker did not load the model within {self.config.worker.startup_timeout_s} s")

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
        return Scheduler(limits, self.tokenizer.eos_ids, debug_invariants=s.debug_invariants)

    async def start(self) -> None:
        self.ready = await self.start_worker()
        self.scheduler = self._new_scheduler(self.ready)
        self._client_sock.bind(self.addresses.client)
        self.clients = LoopSocket(self._client_sock)

    async def _restart_worker(self, reason: str) -> None:
        assert self.scheduler is not None
        self.scheduler.fail_all(reason)
        self._send_completed()
        self.worker.stop(timeout=1.0)
        self.restarts += 1
        if not self.config.worker.restart:
            raise WorkerStartError(reason)
        print(f"runtime: {reason}; restarting the worker", flush=True)
        self.ready = await self.start_worker()
        waiting = self.scheduler.waiting
        self.scheduler = self._new_scheduler(self.ready)
        self.scheduler.waiting = waiting
        self.wakeup.set()

    # ---- client side -----------------------------------------------------------------
    def _send(self, identity: bytes, msg: msgspec.Struct) -> None:
        assert self.clients is not None
        self.clients.send_multipart([identity, cp.client_encoder.encode(msg)])

    def _reply_done(self, req: Request) -> None:
        identity = self.owners.pop(req.rid, None)
        if identity is None:
            return
        if req.detok is not None:
            text = req.detok.text
        else:
            ids = req.output_ids[:-1] if req.finish_reason == "stop" else req.output_ids  # a stop token is not text
            text = self.tokenizer.decode(ids)
        self._send(
            identity,
            cp.Done(
                rid=req.rid,
                finish_reason=req.finish_reason or "error",
                token_ids=req.output_ids,
                text=text,
                prompt_tokens=req.prompt_len,
                cached_tokens=req.prefix_len,
                error=req.error,
            ),
        )

    async def client_loop(self) -> None:
        assert self.clients is not None
        while True:
            frames = await self.clients.recv_multipart()
            assert frames is not None  # no timeout: only a message ends the wait
            identity, payload = frames
            try:
                msg = cp.client_msg_decoder.decode(payload)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._send(identity, cp.ProtocolError(rid=_guess_rid(payload), message=f"malformed message: {exc}"))
                continue
            if isinstance(msg, cp.Generate):
                self._on_generate(identity, msg)
            elif isinstance(msg, cp.Abort):
                assert self.scheduler is not None
                req = self.scheduler.abort(msg.rid)
                self._send(identity, cp.AbortReply(rid=msg.rid, found=req is not None))
                self._send_completed()
            elif isinstance(msg, cp.StatusQuery):
                self._send(identity, self._status(msg.rid))

    def _on_generate(self, identity: bytes, msg: cp.Generate) -> None:
        assert self.scheduler is not None
        rid = msg.rid or uuid.uuid4().hex

        def reject(error: str) -> None:
            self._send(identity, cp.Done(rid=rid, finish_reason="error", error=error))

        if rid in self.owners:
            return reject(f"request id {rid!r} is already in use")
        if (msg.prompt is None) == (msg.token_ids is None):
            return reject("give exactly one of prompt or token_ids")
        ids = self.tokenizer.encode(msg.prompt) if msg.prompt is not None else list(msg.token_ids or [])
        try:
            max_new = self.scheduler.validate(ids, msg.max_tokens, msg.temperature)
        except RequestRejected as exc:
            return reject(str(exc))
        params = SamplingParams(
            max_tokens=msg.max_tokens,
            temperature=msg.temperature,
            ignore_eos=msg.ignore_eos,
            stop_token_ids=frozenset(msg.stop_token_ids),
        )
        req = Request(rid=rid, prompt_ids=ids, params=params, max_new=max_new, stream=msg.stream)
        if msg.stream:
            req.detok = Detokenizer(self.tokenizer)  # non-streaming requests decode once, at the end
        req.arrived_at = time.monotonic()
        self.owners[rid] = identity
        self.scheduler.add(req)
        self.wakeup.set()

    def _status(self, rid: str) -> cp.StatusReply:
        s = self.scheduler
        assert s is not None and self.ready is not None
        return cp.StatusReply(
            rid=rid,
            model=self.config.model.path,
            model_type=self.ready.model_type,
            waiting=len(s.waiting),
            running=len(s.running),
            kv_slots_total=s.slots.capacity,
            kv_slots_free=s.slots.free_count,
            kv_slots_cached=s.tree.total_size if s.tree is not None else 0,
            worker_restarts=self.restarts,
            max_context=self.ready.max_context,
            worker_pid=self.worker.pid or 0,
            aux_slots_total=s.aux.slots.capacity if s.aux is not None else 0,
            aux_slots_free=s.aux.slots.free_count if s.aux is not None else 0,
            aux_slots_cached=len(s.tree.owned_aux_slots()) if s.aux is not None and s.tree is not None else 0,
            steps=self.steps_done,
            worker_idle_s=self.last_step.idle_s if self.last_step is not None else 0.0,
            worker_uptime_s=self.last_step.uptime_s if self.last_step is not None else 0.0,
        )

    def _emit(self, out: StepOutput) -> None:
        req = out.req
        if req.stream:
            stop_token = out.finished and req.finish_reason == "stop"
            delta = "" if stop_token else req.detok.add(out.new_ids)
            if out.finished:
                delta += req.detok.flush()
            identity = self.owners.get(req.rid)
            if identity is not None:
                chunk = cp.Chunk(rid=req.rid, token_ids=out.new_ids, text=delta)
                self._outbox.setdefault(identity, []).append(chunk)

    def _send_completed(self) -> None:
        """Final results, only once each request's state is cached and released (SPEC 5.2)."""
        assert self.scheduler is not None
        for req in self.scheduler.pop_completed():
            self._flush_chunks(self.owners.get(req.rid))  # its chunks before its result
            self._reply_done(req)

    def _flush_chunks(self, identity: bytes | None = None) -> None:
        """Send buffered chunks: one message per client (or just ``identity``'s)."""
        targets = [identity] if identity is not None else list(self._outbox)
        for ident in targets:
            chunks = self._outbox.pop(ident, None)
            if chunks:
                msg = chunks[0] if len(chunks) == 1 else cp.ChunkBatch(chunks=chunks)
                self._send(ident, msg)

    # ---- the step loop ---------------------------------------------------------------
    async def step_loop(self) -> None:
        while True:
            s = self.scheduler
            assert s is not None and self.worker_sock is not None
            if not s.inflight and s.waiting and self.config.scheduler.admit_window_ms:
                # Idle until now: let the rest of a burst arrive and join this step.
                await asyncio.sleep(self.config.scheduler.admit_window_ms / 1000)
            while len(s.inflight) < s.pipeline_depth:
                planned = s.next_step()
                if planned is None:
                    break
                try:
                    self.worker_sock.send(wp.worker_encoder.encode(planned.step))
                except zmq.Again:
                    # PAIR refuses sends only when no worker is connected.
                    code = self.worker.exit_code()
                    await self._restart_worker(f"worker died (exit status {code})" if code is not None else "worker disconnected")
                    break
            if not s.inflight:
                self.wakeup.clear()
                try:
                    await asyncio.wait_for(self.wakeup.wait(), WORKER_POLL_S)
                except asyncio.TimeoutError:
                    pass
                if (code := self.worker.exit_code()) is not None:
                    await self._restart_worker(f"worker died (exit status {code})")
                continue
            payload = await self.worker_sock.recv(WORKER_POLL_S)
            if payload is None:
                if (code := self.worker.exit_code()) is not None:
                    await self._restart_worker(f"worker died (exit status {code})")
                continue
            reply = wp.worker_reply_decoder.decode(payload)
            if isinstance(reply, wp.StepDone):
                self.last_step = reply
                self.steps_done += 1
                for out in s.on_step_done(reply.step_id, reply.tokens):
                    self._emit(out)
                self._send_completed()
                self._flush_chunks()
            elif isinstance(reply, wp.StepFailed):
                s.on_step_failed(reply.step_id, reply.error)
                self._send_completed()

    async def serve_forever(self) -> None:
        tasks = [asyncio.create_task(self.client_loop()), asyncio.create_task(self.step_loop())]
        try:
            done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                task.result()
        finally:
            for task in tasks:
                task.cancel()

    async def shutdown(self) -> None:
        """Fail what is left, stop the worker, close sockets."""
        if self.scheduler is not None:
            for req in list(self.scheduler.waiting):  # fail_all covers the running ones
                req.error = "the service is shutting down"
                self.scheduler.finish(req, "error")
            self.scheduler.fail_all("the service is shutting down")
            self._send_completed()
        if self.worker_sock is not None and self.worker.proc is not None and self.worker.exit_code() is None:
            try:
                self.worker_sock.send(wp.worker_encoder.encode(wp.Shutdown()))
            except zmq.ZMQError:
                pass  # no peer: the worker is gone already
        self.worker.stop(timeout=3.0)
        if self.clients is not None:
            self.clients.close()
        else:
            self._client_sock.close(0)
        if self.worker_sock is not None:
            self.worker_sock.close()
        self.ctx.term()


def _guess_rid(payload: bytes) -> str:
    try:
        value = msgspec.msgpack.decode(payload)
    except msgspec.DecodeError:
        return ""
    rid = value.get("rid") if isinstance(value, dict) else None
    return rid if isinstance(rid, str) else ""
