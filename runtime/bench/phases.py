"""The bench's phases: services up for the runtime side, mlx-lm in-process, and the workloads
that need their own services (paired, mixed)."""

from __future__ import annotations

import argparse
import dataclasses
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from runtime.bench.service import ServiceSpec

MEMORY_PROMPT = (8, 200)
MEMORY_GEN = (1, 64)


def service_spec(args: argparse.Namespace, model: Path, workloads: list[str], cache: bool) -> ServiceSpec:
    """Limits that fit every request of the chosen workloads, with a little slack."""
    from runtime.bench.service import ServiceSpec

    running, context, slots = 1, 64, 0
    if any(w in workloads for w in ("single", "sweep", "paired", "sampling", "structured")):
        n = max(args.concurrency) if "sweep" in workloads else 1
        n = max(n, args.sampling_streams) if "sampling" in workloads or "structured" in workloads else n
        seq = args.prompt_len + args.gen_len
        running, context, slots = max(running, n), max(context, seq), max(slots, n * seq)
    if "prefix" in workloads:
        seq = args.prefix_len + args.prefix_unique[-1] + args.prefix_gen
        n = args.prefix_requests
        running, context, slots = max(running, n), max(context, seq), max(slots, n * seq)
    if "memory" in workloads:
        seq = MEMORY_PROMPT[1] + MEMORY_GEN[1]
        n = args.memory_concurrency
        running, context, slots = max(running, n), max(context, seq), max(slots, n * seq)
    if "long" in workloads:
        seq = max(args.long_lens) + args.long_gen
        context, slots = max(context, seq), max(slots, seq)
    return ServiceSpec(
        model=model,
        max_running=running,
        max_context=context + 16,
        kv_slots=args.kv_slots or slots + 2 * context + 64,
        cache_enabled=cache,
        max_step_tokens=args.max_step_tokens,
        prefill_chunk=args.prefill_chunk,
        blas=args.blas,
        fuse_projections=args.fuse_projections,
    )


def runtime_phase(args: argparse.Namespace, model: Path, plans: list[Any], services: dict[str, Any], rep: int,
                   log: Any) -> None:
    """Every plan's runtime side, with fresh services that are gone when this returns."""
    from runtime.bench.service import Service

    work = args.work_dir
    spec = service_spec(args, model, [p.name for p in plans], cache=True)
    log(f"starting the runtime (cache on): {spec}")
    with Service(spec, work / "configs" / "cache-on.toml") as on:
        log(on.banner)
        services["cache_on"] = vars(spec) | {"model": str(model)}
        pids = {"worker": on.worker_pid()}
        for plan in plans:
            if plan.name != "prefix":
                plan.run_runtime({"on": on.address}, rep)
            else:
                off_spec = service_spec(args, model, ["prefix"], cache=False)
                log("starting the runtime (cache off)")
                with Service(off_spec, work / "configs" / "cache-off.toml") as off:
                    services["cache_off"] = vars(off_spec) | {"model": str(model)}
                    plan.run_runtime({"on": on.address, "off": off.address}, rep)
            log_gpu(log, pids)


def mlx_phase(model: Path, plans: list[Any], rep: int, log: Any) -> None:
    """Every plan's mlx-lm side, in this process, with the device to itself."""
    from runtime.bench.mlx_side import MlxLm

    log("loading the model in-process for mlx-lm")
    mlx = MlxLm(model)
    for plan in plans:
        plan.run_mlx(mlx, rep)
        log_gpu(log, {"bench": os.getpid()})
    mlx.release()


def first_phase(args: argparse.Namespace, model: Path, bench: Any, services: dict[str, Any], log: Any) -> Any:
    """The ``first`` workload: fresh services and fresh mlx-lm loads, one request each, alternated."""
    from runtime.bench.first_request import FirstRequest
    from runtime.bench.mlx_side import MlxLm
    from runtime.bench.service import Service

    spec = service_spec(args, model, ["single"], cache=True)
    if args.service_defaults:
        spec = dataclasses.replace(spec, max_running=0, max_context=0, kv_slots=0)
    services["first"] = vars(spec) | {"model": str(model)}
    first = FirstRequest(bench, args.prompt_len, args.gen_len, args.pairs)
    log(f"first: {args.pairs} pairs of a fresh service's first request and a fresh mlx-lm's: {spec}")
    first.run(lambda: Service(spec, args.work_dir / "configs" / "first.toml"), lambda: MlxLm(model))
    return first.outcome()


def paired_phase(args: argparse.Namespace, model: Path, bench: Any, services: dict[str, Any], log: Any) -> Any:
    """The ``paired`` workload: a service and mlx-lm loaded together, single streams alternated."""
    from runtime.bench.mlx_side import MlxLm
    from runtime.bench.paired import PairedSingle
    from runtime.bench.service import Service

    spec = service_spec(args, model, ["paired"], cache=True)
    paired = PairedSingle(bench, args.prompt_len, args.gen_len, args.pairs)
    log(f"starting the runtime for the paired workload: {spec}")
    with Service(spec, args.work_dir / "configs" / "paired.toml") as svc:
        log(svc.banner)
        services["paired"] = vars(spec) | {"model": str(model)}
        log("loading the model in-process for mlx-lm (the service stays up, idle while mlx-lm runs)")
        mlx = MlxLm(model)
        try:
            paired.run(svc.address, mlx)
        finally:
            mlx.release()
    return paired.outcome()


def mixed_phase(args: argparse.Namespace, model: Path, bench: Any, services: dict[str, Any], log: Any) -> Any:
    """The ``mixed`` workload: the runtime's gateway, then (with the service gone) ``mlx_lm.server``."""
    from runtime.bench import runtime_side
    from runtime.bench.gpu_watch import GpuWatch
    from runtime.bench.http_side import wait_http
    from runtime.bench.mixed import Mixed, MixedShape
    from runtime.bench.mlx_server import MlxServer
    from runtime.bench.service import Service, ServiceSpec

    shape = MixedShape(
        requests=args.mixed_requests, rate=args.mixed_rate, prompt_median=args.mixed_prompt_median,
        prompt_max=args.mixed_prompt_max, gen=(args.mixed_gen[0], args.mixed_gen[-1]),
        prefix_requests=args.mixed_prefix_requests, prefix_len=args.mixed_prefix_len,
        suffix=(args.mixed_prefix_suffix[0], args.mixed_prefix_suffix[-1]),
        ttft_slo_ms=args.goodput_ttft_ms, tpot_slo_ms=args.goodput_tpot_ms, stop_at_eos=args.mixed_stop_at_eos,
    )
    plan = Mixed(bench, shape)
    # Step budget and prefill chunk stay the service's own (0 unless the flags say otherwise);
    # the pool is the service's default (kv_slots 0) unless --kv-slots sets one.
    spec = ServiceSpec(
        model=model, max_running=0, max_context=plan.max_context(),
        kv_slots=args.kv_slots, max_step_tokens=args.max_step_tokens, prefill_chunk=args.prefill_chunk,
        blas=args.blas, fuse_projections=args.fuse_projections, http_port=args.http_port,
    )
    log(f"starting a runtime with the HTTP gateway for the mixed workload: {spec}")
    with Service(spec, args.work_dir / "configs" / "mixed.toml") as svc:
        services["mixed"] = vars(spec) | {"model": str(model)}
        url = f"http://127.0.0.1:{args.http_port}"
        wait_http(url, svc)
        log(svc.banner)

        def shapes() -> tuple[int, int]:
            status = runtime_side.status(svc.address)
            return status.worker_prefill_shapes, status.worker_decode_traces

        with GpuWatch() as watch:
            plan.run("runtime", url, shapes, pid=svc.pid)
        peaks = watch.summary({"worker": svc.worker_pid()})
        if peaks:
            log(f"mixed/runtime: {peaks}")
    if args.mixed_runtime_only:
        log("mixed: mlx_lm.server skipped (--mixed-runtime-only): no ratios in this run")
        return plan.outcome()
    log_gpu(log, {"bench": os.getpid()})  # what is left on the device before mlx_lm.server starts
    log(f"starting mlx_lm.server (--decode-concurrency {args.mlx_server_concurrency})")
    with MlxServer(model, args.mlx_server_concurrency) as server, GpuWatch() as watch:
        services["mixed_mlx_server"] = {"command": server.command()}
        server_pid = server.proc.pid if server.proc is not None else None
        plan.run("mlx_lm", server.url, pid=server_pid)
        peaks = watch.summary({"mlx_lm.server": server_pid, "bench": os.getpid()})
        if peaks:
            log(f"mixed/mlx-lm: {peaks}")
            services["mixed_mlx_server"]["gpu_memory"] = peaks
        # its first traceback and last lines: streams it cut short end without a finish, not with an error
        services["mixed_mlx_server"]["first_error"] = server.error()
        services["mixed_mlx_server"]["log_tail"] = server.log()[-6000:]
        if server.error():
            log(f"mixed/mlx-lm: the server printed a traceback; its first:\n{server.error()}")
            hint = server_hint(server.error(), args.mlx_server_concurrency)
            if hint:
                log(f"mixed/mlx-lm: {hint}")
    return plan.outcome()


def server_hint(error: str, concurrency: int) -> str | None:
    """What to try when ``mlx_lm.server`` died of ``error`` at ``--decode-concurrency
    concurrency``: at 128 rows it ran out of device memory on an H100 under the 1B mixed load at
    10-30/s (session 40); at its own default, 32, it completed 10/s."""
    if "out of memory" not in error or concurrency <= 32:
        return None
    return (f"it ran out of device memory at --decode-concurrency {concurrency}; its own default, 32, "
            "completed 10/s on an 80 GB card (--mlx-server-concurrency 32)")


def log_gpu(log: Any, pids: dict[str, int | None]) -> None:
    """A progress line with the device memory of the named processes, where nvidia-smi answers."""
    from runtime.bench.service import gpu_memory_bytes

    gpu = gpu_memory_bytes()
    if gpu:
        held = ", ".join(f"{name} {gpu.get(pid, 0) / 2**30:.1f} GiB" for name, pid in pids.items() if pid)
        log(f"GPU memory: {held} (all processes: {sum(gpu.values()) / 2**30:.1f} GiB)")
