"""The facts ``runtime status`` shows: model, queue, slots, worker and client connections."""

from __future__ import annotations

from runtime.config import Config
from runtime.protocol import client as cp
from runtime.protocol import worker as wp
from runtime.scheduler.core import Scheduler
from runtime.scheduler.peers import PeerTable
from runtime.scheduler.supervisor import WorkerSupervisor


def status_reply(
    rid: str,
    config: Config,
    ready: wp.Ready,
    s: Scheduler,
    supervisor: WorkerSupervisor,
    peers: PeerTable,
    *,
    tokenizing: int,
    steps: int,
    last_step: wp.StepDone | None,
) -> cp.StatusReply:
    """A StatusReply; ``waiting`` counts requests still being tokenized too."""
    return cp.StatusReply(
        rid=rid,
        model=config.model.path,
        model_type=ready.model_type,
        waiting=len(s.waiting) + tokenizing,
        running=len(s.running),
        kv_slots_total=s.slots.capacity,
        kv_slots_free=s.slots.free_count,
        kv_slots_cached=s.tree.total_size if s.tree is not None else 0,
        worker_restarts=supervisor.restarts,
        max_context=ready.max_context,
        worker_pid=supervisor.pid,
        aux_slots_total=s.aux.slots.capacity if s.aux is not None else 0,
        aux_slots_free=s.aux.slots.free_count if s.aux is not None else 0,
        aux_slots_cached=len(s.tree.owned_aux_slots()) if s.aux is not None and s.tree is not None else 0,
        steps=steps,
        worker_idle_s=last_step.idle_s if last_step is not None else 0.0,
        worker_uptime_s=last_step.uptime_s if last_step is not None else 0.0,
        worker_state=supervisor.state,
        max_waiting=config.scheduler.max_waiting,
        max_message_bytes=int(config.server.max_message_mb * 2**20),
        clients=len(peers.peers),
        replies_queued=sum(len(p.outbox) for p in peers.backlogged),
        max_running=ready.max_rows,
        max_step_tokens=ready.max_step_tokens,
        prefill_chunk=ready.prefill_chunk,
        worker_prefill_shapes=last_step.prefill_shapes if last_step is not None else 0,
        worker_decode_traces=last_step.decode_traces if last_step is not None else 0,
        mask_s=s.mask_clock.seconds,
        mask_steps=s.mask_clock.steps,
    )
