"""Keeps one MLX worker up: starts it, notices when it dies or hangs, restarts it with backoff."""

from __future__ import annotations

import asyncio
import time
from collections import deque

import zmq

from runtime.config import Config
from runtime.protocol import worker as wp
from runtime.protocol.loop_socket import LoopSocket
from runtime.scheduler.rank_processes import worker_process

WORKER_POLL_S = 0.5
RESTART_WINDOW_S = 600.0
RESTART_ATTEMPTS = 6
"""At most this many restart attempts in RESTART_WINDOW_S; then the service gives up."""
BACKOFF_S = (0.0, 1.0, 2.0, 4.0, 8.0, 16.0)


class WorkerStartError(RuntimeError):
    """The worker could not load the model; the message is the loader's."""


class WorkerSupervisor:
    """The worker process, its PAIR socket, and its state: "starting", "up" or "restarting".

    ``last_progress`` is when the worker last answered (or was last handed work while idle);
    ``hung()`` says whether it has been silent for ``worker.step_timeout_s`` with work in flight.
    """

    def __init__(self, config: Config, ctx: zmq.Context, address: str) -> None:
        self.config = config
        self.ctx = ctx
        self.address = address
        self.process = worker_process(config, address)  # one process, or the tensor-parallel ranks
        self.sock: LoopSocket | None = None
        self.state = "starting"
        self.down_reason = ""
        self.restarts = 0
        self.last_progress = time.monotonic()
        self._attempts: deque[float] = deque()
        self._launched_at = 0.0

    @property
    def pid(self) -> int:
        return self.process.pid or 0

    def exit_code(self) -> int | None:
        return self.process.exit_code()

    async def start(self) -> wp.Ready:
        """Start a worker and wait for it to load the model; raises WorkerStartError."""
        self.launch()
        return await self.wait_ready()

    def launch(self) -> None:
        """Bind the worker socket and start the worker process; its start-up (imports, model
        load, warm-up) runs on its own from here, while the caller does its own (the tokenizer)."""
        if self.sock is not None:
            self.sock.close()
        sock = self.ctx.socket(zmq.PAIR)
        sock.setsockopt(zmq.LINGER, 0)
        sock.bind(self.address)
        self.sock = LoopSocket(sock)
        self.process.start()
        self._launched_at = time.monotonic()

    async def wait_ready(self) -> wp.Ready:
        """Wait for the launched worker's Ready (``worker.startup_timeout_s`` from its launch);
        raises WorkerStartError."""
        assert self.sock is not None, "launch() first"
        timeout = self.config.worker.startup_timeout_s
        deadline = self._launched_at + timeout
        while time.monotonic() < deadline:
            payload = await self.sock.recv(WORKER_POLL_S)
            if payload is not None:
                reply = wp.worker_reply_decoder.decode(payload)
                if isinstance(reply, wp.LoadFailed):
                    self.process.stop()
                    raise WorkerStartError(reply.error)
                assert isinstance(reply, wp.Ready)
                self.state = "up"
                self.last_progress = time.monotonic()
                return reply
            code = self.process.exit_code()
            if code is not None:
                raise WorkerStartError(f"worker exited with status {code} while loading the model")
        self.process.kill()
        raise WorkerStartError(f"worker did not load the model within {timeout} s")

    async def restart(self, reason: str) -> wp.Ready:
        """Replace a dead or hung worker; retry with backoff; raise WorkerStartError when out of attempts."""
        self.state = "restarting"
        self.down_reason = reason
        self.process.kill()
        if not self.config.worker.restart:
            raise WorkerStartError(f"{reason} (worker.restart is off)")
        while True:
            now = time.monotonic()
            while self._attempts and now - self._attempts[0] > RESTART_WINDOW_S:
                self._attempts.popleft()
            if len(self._attempts) >= RESTART_ATTEMPTS:
                raise WorkerStartError(
                    f"the worker failed {len(self._attempts)} times in {RESTART_WINDOW_S:.0f} s; last: {self.down_reason}"
                )
            delay = BACKOFF_S[min(len(self._attempts), len(BACKOFF_S) - 1)]
            self._attempts.append(now)
            self.restarts += 1
            print(f"runtime: {self.down_reason}; restarting the worker" + (f" in {delay:.0f} s" if delay else ""), flush=True)
            if delay:
                await asyncio.sleep(delay)
            try:
                return await self.start()
            except WorkerStartError as exc:
                self.down_reason = f"restart failed: {exc}"
                self.process.kill()

    def note_progress(self) -> None:
        self.last_progress = time.monotonic()

    def hung(self, now: float) -> bool:
        return now - self.last_progress > self.config.worker.step_timeout_s

    def send(self, payload: bytes) -> None:
        """Send one message to the worker (raises zmq.Again when none is connected)."""
        assert self.sock is not None
        self.sock.send(payload)

    async def recv(self, timeout: float) -> bytes | None:
        assert self.sock is not None
        return await self.sock.recv(timeout)

    def shutdown(self) -> None:
        """Ask a live worker to exit, stop it, close the socket."""
        if self.sock is not None and self.process.proc is not None and self.process.exit_code() is None:
            try:
                self.sock.send(wp.worker_encoder.encode(wp.Shutdown()))
            except zmq.ZMQError:
                pass  # no peer: the worker is gone already
        self.process.stop(timeout=3.0)
        if self.sock is not None:
            self.sock.close()
            self.sock = None
