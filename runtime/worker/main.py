"""The worker process: receive steps, launch them, report finalized tokens.

Loop shape: step N+1's graph is built from step N's lazy tokens while step N runs; then
step N is read back, step N+1 is submitted, and step N's tokens are reported. Submitting
only after the read-back keeps the KV/aux pool updates in place (a graph still in
flight would hold the pools and force MLX to copy them on every write). Steps that write
nothing in place (paged-kernel decode steps, whose K/V go to the decode tail) and every
decode step where ``overlap.overlap_submit`` says so (a GPU with small pools, where that
copy is cheaper than the launch gap; the CPU with compiled decode, where the writes stay
in place) are submitted before N is read back.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import time
import traceback
from collections import deque
from typing import TYPE_CHECKING

import zmq

from runtime.config import Config, parse_config
from runtime.heap import freeze_startup_heap
from runtime.import_guard import keep_torch_out
from runtime.protocol.worker import (
    LoadFailed,
    Masks,
    Ready,
    Shutdown,
    Step,
    StepDone,
    StepFailed,
    worker_cmd_decoder,
    worker_encoder,
)

if TYPE_CHECKING:
    from runtime.worker.ranks import RankRole

PARENT_POLL_MS = 500
OOM_HINT = ("; the device ran out of memory while the worker started: another process may hold some of it, or "
            "set [cache] kv_slots (or lower cache.kv_memory_fraction, scheduler.max_running or max_context) to "
            "leave more room")


def load_error(exc: BaseException) -> str:
    """The load failure as the client and ``runtime up`` show it, with what to change where the
    device ran out of memory."""
    text = f"{type(exc).__name__}: {exc}"
    return text + OOM_HINT if "out of memory" in str(exc).lower() else text


def serve(config: Config, address: str, trace_path: str | None = None, role: RankRole | None = None) -> int:
    """Serve steps from ``address``: the scheduler's socket, or rank 0's fan-out for a follower rank."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    parent = os.getppid()
    fanout = None
    begun = time.perf_counter()
    try:
        import mlx.core as mx

        from runtime.worker.decode_warmup import warm_decode
        from runtime.worker.engine import Engine
        from runtime.worker.loader import buffer_cache_bytes, load
        from runtime.worker.model.fused_projections import stacked_line
        from runtime.worker.overlap import overlap_submit
        from runtime.worker.paths.cuda.cuda_graphs import (
            GRAPHS_VAR,
            launch_directly,
            lift_graph_size_limit,
        )
        from runtime.worker.paths.cuda.kernel_cache import keep_kernel_cache
        from runtime.worker.paths.prefill_shapes import keep_attention_graphs, padding_wanted
        from runtime.worker.paths.prefill_warmup import warm_prefill
        from runtime.worker.paths.rows.parallel_attention import default_streams

        imported = time.perf_counter()
        cuda = mx.cuda.is_available()
        lift_graph_size_limit(os.environ, cuda)  # before the first device operation
        if launch_directly(os.environ, cuda):
            print(f"runtime worker: CUDA graphs off ({GRAPHS_VAR}=0: faster here; set it to 1 to use them)", flush=True)
        keep_attention_graphs(os.environ, cuda)
        device_name = str(mx.device_info().get("device_name", "")) if cuda else ""
        kernels = keep_kernel_cache(os.environ, cuda, mx.__version__, device_name)  # before the first kernel build
        if kernels:
            print(f"runtime worker: CUDA kernel cache {kernels}", flush=True)
        mx.random.seed(config.model.seed)
        group = None
        if role is not None:
            from runtime.worker.ranks import Fanout, init_group

            fanout = Fanout(ctx, role.followers) if role.leader else None  # bound before the followers connect
            group = init_group(config.distributed.backend, role)
        load_started = time.perf_counter()
        loaded = load(config, group)
        print(f"runtime worker: loaded the model in {time.perf_counter() - load_started:.1f} s"
              f" ({load_started - begun:.1f} s of imports and device set-up before: imports"
              f" {imported - begun:.1f} s, device set-up {load_started - imported:.1f} s)", flush=True)
        layout = loaded.layout
        if not layout.traceable:
            print("runtime worker: this model's forward reads arrays back mid-forward (mx.compile cannot trace "
                  "it); decode runs uncompiled", flush=True)
        if loaded.fused_groups:
            print(f"runtime worker: fused {loaded.fused_groups} projection groups; {stacked_line(loaded.stacked_rows)}",
                  flush=True)
        if loaded.norm_offsets:
            print(f"runtime worker: {loaded.norm_offsets} RMSNorms of 1 + weight have the sum computed once", flush=True)
        if loaded.residual_blocks:
            print(f"runtime worker: {loaded.residual_blocks} blocks add their residuals and RMS-normalize the sums "
                  f"together: {loaded.residual_kernel}", flush=True)
        if loaded.transposed:
            print(f"runtime worker: {loaded.transposed} float32 products on transposed weights (the bundled "
                  "reference BLAS runs those faster, with the same bits)", flush=True)
        paths_started = time.perf_counter()
        pool, aux_pool = loaded.make_pools()
        pools_s = time.perf_counter() - paths_started
        pool_bytes = pool.nbytes + (aux_pool.nbytes if aux_pool is not None else 0)
        default_cache = mx.set_cache_limit(0)
        mx.set_cache_limit(buffer_cache_bytes(config.worker.buffer_cache_mb, default_cache, pool_bytes))
        engine = Engine(loaded.model, layout, pool, loaded.limits.max_running, loaded.max_context, aux_pool,
                        compile_decode=config.worker.compile_decode,
                        pad_shapes=padding_wanted(config.worker.pad_shapes, mx.default_device().type == mx.DeviceType.gpu),
                        attention_streams=config.worker.attention_threads or default_streams(os.cpu_count()))
        if group is not None:  # the padding probe's verdict sets prefill shapes: the same on every rank
            from runtime.worker.ranks import agree_all

            engine.pads_recurrent = agree_all(engine.pads_recurrent, group)
        # The pools' allocation and, on a GPU, the paged kernels' builds and start-up check.
        rope = "; the decode kernel rotates queries and keys (RoPE)" if engine.paths.rope else ""
        parts = ", ".join(f"{name} {seconds:.1f} s" for name, seconds in
                          {"pools": pools_s, **engine.startup_seconds}.items())
        print(f"runtime worker: pools and attention paths ready in {time.perf_counter() - paths_started:.1f} s"
              f" ({parts}){rope}", flush=True)
        if engine.gated_delta.use_kernel or engine.gated_delta.problem:
            how = ("one kernel a layer and forward (prompts and decode steps)" if engine.gated_delta.use_kernel
                   else f"mlx-lm's ops, token by token ({engine.gated_delta.problem})")
            print(f"runtime worker: delta-net layers: {how}", flush=True)
        if engine.aux_pool is not None and engine.padded_shapes:
            padded = ("padded at the end (its recurrent layers honour the real lengths)" if engine.pads_recurrent
                      else "each at its own length (its recurrent layers would take end padding into their state)")
            mixed = "; chunks of different starts share a forward" if engine.mixed_starts else ""
            print(f"runtime worker: prompts of a recurrent model: {padded}{mixed}", flush=True)
        started = time.perf_counter()
        variants = warm_decode(engine, lambda line: print(f"runtime worker: warm-up: {line}", flush=True))
        decode_s = time.perf_counter() - started
        sampler_started = time.perf_counter()
        if loaded.vocab_size > 0:
            engine.sampler.warm_up(loaded.vocab_size, layout.kv_dtype)
        sampler_s = time.perf_counter() - sampler_started
        print(f"runtime worker: warm-up: sampler in {sampler_s:.1f} s", flush=True)
        shapes = warm_prefill(engine, loaded.limits.max_step_tokens, loaded.limits.prefill_chunk,
                              lambda line: print(line, flush=True))
        if cuda:
            from runtime.worker.paths.cuda.cubin_kernels import summary

            if (cubins := summary()) is not None:
                print(f"runtime worker: {cubins}", flush=True)
        print(f"runtime worker: warmed up in {time.perf_counter() - started:.1f} s"
              + (f" ({variants} decode variants prepared in {decode_s:.1f} s)" if variants else "")
              + (f" ({shapes} prefill shapes)" if shapes else "")
              + f"; {time.perf_counter() - begun:.1f} s since the worker started", flush=True)
        ready = Ready(
            model_type=loaded.model_type,
            num_slots=loaded.num_slots,
            max_rows=loaded.limits.max_running,
            max_context=loaded.max_context,
            max_step_tokens=loaded.limits.max_step_tokens,
            prefill_chunk=loaded.limits.prefill_chunk,
            limits=loaded.limits.describe(),
            vocab_size=loaded.vocab_size,
            dtype=str(layout.kv_dtype).replace("mlx.core.", ""),
            pool_bytes=pool.nbytes,
            aux_slots=loaded.aux_slots,
            aux_bytes=aux_pool.nbytes if aux_pool is not None else 0,
        )
        if fanout is not None:
            fanout.wait_ready(ready, parent, config.worker.startup_timeout_s)
        freeze_startup_heap()
    except Exception as exc:  # report the loader's error, then exit non-zero
        sock.send(worker_encoder.encode(LoadFailed(error=load_error(exc))))
        time.sleep(0.2)
        return 1
    sock.send(worker_encoder.encode(ready))
    on_gpu = mx.default_device().type == mx.DeviceType.gpu
    overlap = overlap_submit(on_gpu, sum(a.nbytes for a in engine.state_arrays()), config.worker.overlap_submit_max_mb,
                             engine.compiled is not None)
    clock = IdleClock()
    send, recv, poll = sock.send, sock.recv, sock.poll
    trace = None
    if trace_path:
        from runtime.worker.step_trace import StepTrace

        trace = StepTrace(f"{trace_path}.{os.getpid()}")
        trace.wrap_engine(engine)
        send, recv, poll = trace.timed("send", send), trace.timed("recv", recv), trace.timed("poll", poll)
    if role is not None and not role.leader:
        from runtime.worker.ranks import discard

        send = discard
    if fanout is not None:
        recv = fanout.forwarding(recv)
    try:
        return _loop(engine, send, recv, poll, overlap, clock, parent)
    finally:
        if trace is not None:
            trace.write()
        if fanout is not None:
            fanout.close()


def _loop(engine, send, recv, poll, overlap: bool, clock: IdleClock, parent: int) -> int:
    """Take steps and report them until Shutdown or until the scheduler is gone."""
    inbox = Inbox(recv, poll)
    recv, poll = inbox.recv, inbox.poll

    def report(launched) -> None:
        send(worker_encoder.encode(_read_back(engine, launched, clock)))

    pending = None
    while True:
        if pending is not None and not poll(0):
            report(pending)
            pending = None
            clock.idle()
            continue
        if pending is None and not poll(PARENT_POLL_MS):
            if os.getppid() != parent:
                return 0  # the scheduler is gone
            continue
        cmd = worker_cmd_decoder.decode(recv())
        if isinstance(cmd, Shutdown):
            if pending is not None:
                report(pending)
            return 0
        if isinstance(cmd, Masks):
            continue  # for a step that failed before it waited for them
        assert isinstance(cmd, Step)
        try:
            built = engine.build(cmd)
        except Exception as exc:
            if pending is not None:
                report(pending)
                pending = None
            engine.reset_chain()
            traceback.print_exc()
            send(worker_encoder.encode(StepFailed(step_id=cmd.step_id, error=f"{type(exc).__name__}: {exc}")))
            continue
        if pending is not None and pending.first_tokens:
            # First tokens go out now, not after the next submit (on a CPU that blocks for
            # most of a step); steady decode keeps the device busy first.
            report(pending)
            pending = None
        # Built from the previous step's lazy tokens. A step that updates the pools is submitted
        # after that step's read-back, so no in-flight graph holds the pools and the updates
        # stay in place; one that writes nothing in place (a decode step feeding the tail), or
        # any decode step where ``overlap`` says so, goes first, so the device never waits for
        # the host.
        if built.step is None and (overlap or not built.in_place):
            clock.busy()
            engine.submit(built)
            if pending is not None:
                report(pending)
        else:
            previous = _read_back(engine, pending, clock) if pending is not None else None
            engine.settle()  # (the read-back step's hold on the pools released: the writes stay in place)
            clock.busy()
            engine.submit(built)
            if previous is not None:
                send(worker_encoder.encode(previous))
        if built.awaiting is not None:
            if not _apply_masks(engine, built, inbox, parent):
                return 0
            # Its tokens go out at once: the next step's masks need them, and the scheduler
            # computes those while this worker builds and runs that step. The forward is done
            # by now (the masks took longer), so the read-back waits for the sampling only.
            report(built)
            clock.idle()
            pending = None  # the step before it was reported above, with the submit
            continue
        pending = built


class Inbox:
    """The scheduler's commands; steps that came while the worker waited for masks are held
    back, in order, for the loop."""

    def __init__(self, recv, poll) -> None:
        self.socket_recv, self.socket_poll = recv, poll
        self.held: deque[bytes] = deque()

    def poll(self, timeout_ms: int) -> bool:
        return bool(self.held) or bool(self.socket_poll(timeout_ms))

    def recv(self) -> bytes:
        return self.held.popleft() if self.held else self.socket_recv()


def _apply_masks(engine, built, inbox: Inbox, parent: int) -> bool:
    """Wait for the masks of ``built``'s deferred rows (the scheduler sends them once it has the
    previous step's tokens, reported above) and sample the step; False on Shutdown. Steps
    planned meanwhile (the scheduler keeps a pipeline of them) are held for the loop."""
    while True:
        if not inbox.socket_poll(PARENT_POLL_MS):
            if os.getppid() != parent:
                return False
            continue
        raw = inbox.socket_recv()
        cmd = worker_cmd_decoder.decode(raw)
        if isinstance(cmd, Shutdown):
            return False
        if isinstance(cmd, Masks) and cmd.step_id == built.step_id:
            engine.apply_masks(built, cmd.masks)
            return True
        if isinstance(cmd, Step):
            inbox.held.append(raw)


class IdleClock:
    """Time the device had nothing launched: from a read-back that left nothing in flight to the next launch."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.idle_total = 0.0
        self._idle_since: float | None = self.started

    def idle(self) -> None:
        self._idle_since = time.perf_counter()

    def idle_so_far(self, now: float) -> float:
        return self.idle_total + (now - self._idle_since if self._idle_since is not None else 0.0)

    def busy(self) -> None:
        if self._idle_since is not None:
            self.idle_total += time.perf_counter() - self._idle_since
            self._idle_since = None


def _read_back(engine, launched, clock: IdleClock) -> StepDone | StepFailed:
    try:
        tokens = engine.finalize(launched)
    except Exception as exc:
        engine.reset_chain()
        return StepFailed(step_id=launched.step_id, error=f"{type(exc).__name__}: {exc}")
    now = time.perf_counter()
    done = StepDone(step_id=launched.step_id, tokens=tokens, idle_s=clock.idle_so_far(now), uptime_s=now - clock.started)
    done.prefill_shapes, done.decode_traces = engine.shapes_built
    if launched.logprobs is not None:
        done.logprobs, done.top_ids, done.top_logprobs = launched.logprobs
    done.prompt_logprobs = launched.prompt_logprobs
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="runtime MLX worker (started by the scheduler)")
    parser.add_argument("--address", required=True)
    parser.add_argument("--config-json", required=True)
    parser.add_argument("--rank", type=int, default=None, help="tensor-parallel rank (worker.tensor_parallel > 1)")
    parser.add_argument("--followers", nargs="*", default=[], help="rank 0: the fan-out address of each other rank")
    args = parser.parse_args(argv)
    keep_torch_out()  # before mlx-lm's imports (transformers would import it)
    # A terminal's Ctrl-C, or a service manager's SIGTERM, reaches the whole process group;
    # the scheduler owns this process's end (Shutdown, then SIGKILL if it does not go), so a
    # worker killed by the same signal is not mistaken for a crash and restarted. A dead
    # scheduler is noticed by the loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    config = parse_config(json.loads(args.config_json))
    role = None
    if args.rank is not None:
        from runtime.worker.ranks import RankRole

        role = RankRole(args.rank, config.worker.tensor_parallel, tuple(args.followers))
    trace = os.environ.get("RUNTIME_WORKER_TRACE")
    out = os.environ.get("RUNTIME_WORKER_CPROFILE")
    if out:
        import cProfile
        prof = cProfile.Profile()
        try:
            return prof.runcall(serve, config, args.address, trace, role)
        finally:
            prof.dump_stats(f"{out}.{os.getpid()}")
    return serve(config, args.address, trace, role)


if __name__ == "__main__":
    sys.exit(main())
