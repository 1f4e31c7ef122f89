"""Tensor-parallel worker ranks: the mlx.distributed group, the sharded model, the step fan-out.

With ``worker.tensor_parallel = N`` the worker is N processes that run one model together.
Each rank joins the group (``mx.distributed.init``), loads the model lazily and calls mlx-lm's
``model.shard(group)``: attention heads and MLP columns are split across ranks and the
layer outputs are all-summed, so every rank ends a forward with the same hidden states and
the same logits, bit for bit (a ring all-reduce hands every rank the one reduced buffer).
The pools are sized after sharding, so each rank's KV/aux pool holds its own heads under the
same slot ids.

Fan-out: rank 0 keeps the scheduler's one PAIR socket and passes every command it receives,
as the same bytes and before it decodes them, to each follower rank over a PAIR socket of its
own (``Fanout``). Why rank 0 and not a PUB socket in the scheduler: the scheduler stays exactly
as it is with one worker (one socket, one Ready, one reply per step), and a PAIR per follower
is lossless and ordered (a PUB drops what it sends before a subscriber has joined and past
its high-water mark, and a lost step would desynchronise the collectives). Every rank then
runs the same worker loop on the same commands: same slot ids, same chained decode. Sampling
needs no exchange: draws are hashed from each row's seed (the scheduler gives every request
one, random when the client gave none), the position and the token id, over identical
logits, so every rank samples the same tokens. Only rank 0 replies; a follower's reports go
nowhere.

Failure: a follower that dies leaves rank 0 blocked in a collective or unable to forward;
the scheduler's supervisor sees the exit (or the step timeout) and restarts every rank.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import mlx.nn as nn
import zmq

from runtime.protocol.worker import LoadFailed, Ready, worker_reply_decoder
from runtime.worker.defaults import Limits
from runtime.worker.model.discovery import UnsupportedModel

BACKENDS = {"auto": "any", "ring": "ring", "jaccl": "jaccl", "nccl": "nccl"}
POLL_MS = 500


@dataclass(frozen=True)
class RankRole:
    """This process's place in the group; ``followers``: the addresses rank 0 binds, one per
    follower rank, in rank order (empty on followers)."""

    rank: int
    size: int
    followers: tuple[str, ...] = ()

    @property
    def leader(self) -> bool:
        return self.rank == 0


def init_group(backend: str, role: RankRole) -> mx.distributed.Group:
    """Join the group (blocks until every rank has joined); raise when it is not the one launched."""
    group = mx.distributed.init(strict=True, backend=BACKENDS[backend])
    if group.size() != role.size or group.rank() != role.rank:
        raise RuntimeError(f"mlx.distributed gave rank {group.rank()} of {group.size()}, launched as "
                           f"rank {role.rank} of {role.size} (is the backend's environment set?)")
    return group


def shard_model(model: nn.Module, model_type: str, group: mx.distributed.Group) -> None:
    """mlx-lm's tensor-parallel split of ``model`` (still lazy: each rank reads only its slices)."""
    if not callable(getattr(model, "shard", None)):
        raise UnsupportedModel(f"model type {model_type!r} has no tensor-parallel sharding in mlx-lm "
                               f"(no model.shard); set worker.tensor_parallel = 1")
    try:
        model.shard(group)
    except Exception as exc:  # an assert or a split of a width the ranks do not divide
        raise UnsupportedModel(f"model type {model_type!r} cannot be split across {group.size()} ranks: "
                               f"{type(exc).__name__}: {exc}") from exc


def agree_limits(limits: Limits, group: mx.distributed.Group) -> Limits:
    """The smallest of every rank's limits (ranks on other machines may have chosen others),
    so every rank allocates the same pools and the scheduler's slot ids fit them all."""
    mine = mx.array([limits.max_running, limits.max_step_tokens, limits.prefill_chunk, limits.max_context,
                     limits.num_slots, limits.aux_slots], dtype=mx.int32)
    every = mx.distributed.all_gather(mine[None], group=group)
    low = [int(v) for v in mx.min(every, axis=0).tolist()]
    return replace(limits, max_running=low[0], max_step_tokens=low[1], prefill_chunk=low[2],
                   max_context=low[3], num_slots=low[4], aux_slots=low[5])


def agree_all(flag: bool, group: mx.distributed.Group) -> bool:
    """True where every rank's ``flag`` is: for start-up decisions that set a forward's shapes
    (a hybrid's padded prompts), which a collective needs the same on every rank."""
    every = mx.distributed.all_gather(mx.array([[int(flag)]], dtype=mx.int32), group=group)
    return bool(mx.min(every).item())


class Fanout:
    """Rank 0's PAIR sockets to the follower ranks: every scheduler command goes to each, in order."""

    def __init__(self, ctx: zmq.Context, addresses: tuple[str, ...]) -> None:
        self.socks: list[zmq.Socket] = []
        for address in addresses:
            sock = ctx.socket(zmq.PAIR)
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 0)  # never drop or block on a busy follower: it is in lockstep
            sock.bind(address)
            self.socks.append(sock)

    def wait_ready(self, own: Ready, parent: int, timeout_s: float) -> None:
        """Wait for every follower's Ready (each sends one after its warm-up) and check that
        it runs the limits rank 0 reports; raise with the follower's own error otherwise."""
        deadline = time.monotonic() + timeout_s
        for rank, sock in enumerate(self.socks, start=1):
            while not sock.poll(POLL_MS):
                if os.getppid() != parent:
                    raise RuntimeError("the scheduler is gone")
                if time.monotonic() > deadline:
                    raise RuntimeError(f"rank {rank} did not report ready within {timeout_s:g} s")
            reply = worker_reply_decoder.decode(sock.recv())
            if isinstance(reply, LoadFailed):
                raise RuntimeError(f"rank {rank}: {reply.error}")
            assert isinstance(reply, Ready)
            mine = (own.num_slots, own.max_rows, own.max_context, own.aux_slots, own.vocab_size)
            theirs = (reply.num_slots, reply.max_rows, reply.max_context, reply.aux_slots, reply.vocab_size)
            if mine != theirs:
                raise RuntimeError(f"rank {rank} runs (slots, rows, context, aux slots, vocab) {theirs}, "
                                   f"rank 0 {mine}")

    def forwarding(self, recv):
        """``recv`` that passes each command to every follower before returning it."""
        socks = self.socks

        def recv_and_forward() -> bytes:
            raw = recv()
            for rank, sock in enumerate(socks, start=1):
                try:
                    sock.send(raw, zmq.NOBLOCK)
                except zmq.Again:  # a PAIR refuses only when its peer is gone: end, as a worker death
                    raise RuntimeError(f"worker rank {rank} is gone") from None
            return raw

        return recv_and_forward

    def close(self) -> None:
        for sock in self.socks:
            sock.close(0)


def discard(payload: bytes) -> None:
    """A follower's reports: rank 0 alone replies to the scheduler."""
