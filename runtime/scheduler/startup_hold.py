"""Client messages that arrive while the worker is still starting (minutes on a GPU's first start).

The client socket is bound before the model loads and read from the first moment: a status
query is answered at once (``worker_state = "starting"``), and every other message is held
here, in arrival order, until the worker is ready; the server then handles each as if it had
just arrived, so a request sent early waits instead of being refused. Beyond
``scheduler.max_waiting`` held requests a new one is refused at once (overloaded). If the
service never gets a worker, every held request gets its error reply.
"""

from __future__ import annotations

from runtime.config import Config
from runtime.protocol import client as cp
from runtime.scheduler.client_out import ClientOut
from runtime.scheduler.frames import split_frames


class StartupHold:
    """The messages held for the worker, and the status reply of a service still starting."""

    def __init__(self, config: Config, out: ClientOut, worker_pid: int | None) -> None:
        self.config = config
        self.out = out
        self.worker_pid = worker_pid or 0
        self.held: list[list[bytes]] = []
        self._requests: list[tuple[bytes, tuple[bytes, ...], str]] = []  # (identity, envelope, rid) of held Generates

    def on_frames(self, frames: list[bytes]) -> None:
        """Answer a status query now; hold anything else (malformed messages too: their error
        reply comes when they are handled, in order)."""
        try:
            incoming = split_frames(frames)
            msg = cp.client_msg_decoder.decode(incoming.payload)
        except Exception:  # BadFrames, DecodeError, ValidationError, RecursionError: any payload at all
            self.held.append(frames)
            return
        if isinstance(msg, cp.StatusQuery):
            self.out.reply_raw(incoming.identity, incoming.envelope, self.status(msg.rid))
            return
        if isinstance(msg, cp.Generate):
            if len(self._requests) >= self.config.scheduler.max_waiting:
                error = (f"overloaded: {len(self._requests)} requests are waiting for the worker to start "
                         "(scheduler.max_waiting); retry later")
                self.out.reply_raw(incoming.identity, incoming.envelope,
                                   cp.Done(rid=msg.rid, finish_reason="error", error=error))
                return
            self._requests.append((incoming.identity, incoming.envelope, msg.rid))
        self.held.append(frames)

    def status(self, rid: str) -> cp.StatusReply:
        """What is known before the worker reports: the config's limits (0: chosen by the worker)."""
        s = self.config.scheduler
        return cp.StatusReply(
            rid=rid, model=self.config.model.path, model_type="", waiting=len(self._requests), running=0,
            kv_slots_total=0, kv_slots_free=0, kv_slots_cached=0, worker_restarts=0, max_context=s.max_context,
            worker_pid=self.worker_pid, worker_state="starting", max_waiting=s.max_waiting,
            max_message_bytes=int(self.config.server.max_message_mb * 2**20), max_running=s.max_running,
            max_step_tokens=s.max_step_tokens, prefill_chunk=s.prefill_chunk,
        )

    def take(self) -> list[list[bytes]]:
        """The held messages, oldest first, once the worker is ready; the hold is empty after."""
        held, self.held, self._requests = self.held, [], []
        return held

    def fail_all(self, error: str) -> None:
        """The worker never came up: every held request ends with ``error``."""
        for identity, envelope, rid in self._requests:
            self.out.reply_raw(identity, envelope, cp.Done(rid=rid, finish_reason="error", error=error))
        self.take()
