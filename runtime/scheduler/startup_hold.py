"""Client messages that arrive while the worker is still starting (minutes on a GPU's first start).

The client socket is bound before the model loads and read from the first moment. A status
query is answered at once (``worker_state = "starting"``), so are malformed messages (their
protocol error) and aborts (of a held request: it ends as aborted). Requests are held, in
arrival order, until the worker is ready; the server then handles each as if it had just
arrived, so a request sent early waits instead of being refused. At most
``scheduler.max_waiting`` are held (a new one beyond is refused at once: overloaded), so the
hold is bounded whatever a client sends. If the service never gets a worker, every held
request gets its error reply.
"""

from __future__ import annotations

from runtime.config import Config
from runtime.model_folder import model_type_of
from runtime.protocol import client as cp
from runtime.scheduler.client_out import ClientOut
from runtime.scheduler.frames import read_message


class StartupHold:
    """The requests held for the worker, and the status reply of a service still starting."""

    def __init__(self, config: Config, out: ClientOut, worker_pid: int | None) -> None:
        self.config = config
        self.out = out
        self.worker_pid = worker_pid or 0
        self.model_type = model_type_of(config.model.path)
        self._held: list[tuple[bytes, tuple[bytes, ...], cp.Generate]] = []  # identity, envelope, request

    def on_frames(self, frames: list[bytes]) -> None:
        """Hold a request; answer anything else now."""
        identity, envelope, msg = read_message(frames)
        if isinstance(msg, cp.ProtocolError):
            self.out.reply_raw(identity, envelope, msg)
        elif isinstance(msg, cp.StatusQuery):
            self.out.reply_raw(identity, envelope, self.status(msg.rid))
        elif isinstance(msg, cp.Abort):
            self._abort(identity, envelope, msg.rid)
        elif isinstance(msg, cp.Generate):
            if len(self._held) >= self.config.scheduler.max_waiting:
                error = (f"overloaded: {len(self._held)} requests are waiting for the worker to start "
                         "(scheduler.max_waiting); retry later")
                self.out.reply_raw(identity, envelope, cp.Done(rid=msg.rid, finish_reason="error", error=error))
                return
            self._held.append((identity, envelope, msg))

    def _abort(self, identity: bytes, envelope: tuple[bytes, ...], rid: str) -> None:
        index = next((i for i, (who, _, msg) in enumerate(self._held) if who == identity and msg.rid == rid), None)
        self.out.reply_raw(identity, envelope, cp.AbortReply(rid=rid, found=index is not None))
        if index is not None:
            _, held_envelope, _ = self._held.pop(index)
            self.out.reply_raw(identity, held_envelope, cp.Done(rid=rid, finish_reason="abort"))

    def status(self, rid: str) -> cp.StatusReply:
        """What is known before the worker reports: the config's limits (0: chosen by the worker)."""
        s = self.config.scheduler
        return cp.StatusReply(
            rid=rid, model=self.config.model.path, model_type=self.model_type, waiting=len(self._held), running=0,
            kv_slots_total=0, kv_slots_free=0, kv_slots_cached=0, worker_restarts=0, max_context=s.max_context,
            worker_pid=self.worker_pid, worker_state="starting", max_waiting=s.max_waiting,
            max_message_bytes=int(self.config.server.max_message_mb * 2**20), max_running=s.max_running,
            max_step_tokens=s.max_step_tokens, prefill_chunk=s.prefill_chunk,
        )

    def take(self) -> list[tuple[bytes, tuple[bytes, ...], cp.Generate]]:
        """The held requests (identity, envelope, request), oldest first, once the worker is
        ready; the hold is empty after."""
        held, self._held = self._held, []
        return held

    def fail_all(self, error: str) -> None:
        """The worker never came up: every held request ends with ``error``."""
        for identity, envelope, msg in self._held:
            self.out.reply_raw(identity, envelope, cp.Done(rid=msg.rid, finish_reason="error", error=error))
        self._held = []

