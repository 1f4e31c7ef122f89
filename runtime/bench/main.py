"""``runtime bench``: argument parsing and the run itself (services up, workloads, report)."""

from __future__ import annotations

import argparse
import dataclasses
import os
import signal
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    pass

WORKLOADS = ("single", "sweep", "prefix", "memory", "paired", "first", "sampling", "http", "long", "mixed", "structured")
DEFAULT_WORKLOADS = "single,sweep,prefix"


def _ints(text: str) -> list[int]:
    """``"1,4,16"`` -> ``[1, 4, 16]`` (positive integers)."""
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _workloads(text: str) -> list[str]:
    """Workload names from a comma list, or every one for ``all``."""
    names = [w.strip() for w in text.split(",") if w.strip()]
    if names == ["all"]:
        return list(WORKLOADS)
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {bad}; choose from {', '.join(WORKLOADS)} or 'all'")
    return names


def build_parser() -> argparse.ArgumentParser:
    """The bench's command line (``runtime bench --help``)."""
    p = argparse.ArgumentParser(
        prog="runtime bench",
        description="Benchmark the runtime against mlx-lm on the same model in the same run.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an existing mlx-lm model folder")
    # each also "-4bit" (models.py quantizes every shape)
    shapes = ("tiny", "llama-1b", "llama-8b", "gemma3-tiny", "gemma3-1b", "gpt-oss-tiny", "gpt-oss-20b-8e",
              "deepseek-v3-tiny", "moonlight-16b-8e", "qwen3-next-tiny", "qwen3-next-24l-dense")
    src.add_argument("--synthetic", choices=shapes + tuple(f"{s}-4bit" for s in shapes),
                     help="a random-weight model shape (NAME-4bit: quantized as mlx_lm.convert -q)")
    p.add_argument("--synthetic-tokenizer", choices=("words", "bytes"), default="words",
                   help="synthetic models' tokenizer: word-level (default) or byte-level (structured needs bytes)")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/runtime-bench"), help="synthetic models, configs")
    p.add_argument("--workloads", type=_workloads, default=_workloads(DEFAULT_WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} or 'all' (default {DEFAULT_WORKLOADS})")
    p.add_argument("--prompt-len", type=int, default=256, help="single and sweep prompt tokens")
    p.add_argument("--gen-len", type=int, default=256, help="single and sweep new tokens")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64, 256], help="sweep levels, e.g. 1,4,16")
    p.add_argument("--sampling-streams", type=int, default=64, help="sampling and structured: concurrent streams")
    p.add_argument("--sampling-rounds", type=int, default=3, help="sampling and structured: alternating runs of each kind")
    p.add_argument("--http-streams", type=int, default=64, help="http: concurrent streams")
    p.add_argument("--http-port", type=int, default=18431, help="http and mixed: the gateway's loopback port")
    p.add_argument("--http-workers", type=int, default=1, help="http: gateway processes ([http] workers)")
    p.add_argument("--pin-clients", action="store_true",
                   help="http: service and client processes on separate halves of the physical cores")
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--prefix-unique", type=_ints, default=[16, 64], help="min,max unique tokens per request")
    p.add_argument("--prefix-gen", type=int, default=32)
    p.add_argument("--pairs", type=int, default=8,
                   help="paired and first: alternating single-stream runs per side (paired: service and mlx-lm loaded "
                        "together; first: a fresh service and a fresh mlx-lm load per pair)")
    p.add_argument("--http-pairs", type=int, default=9,
                   help="http: alternating single-stream pairs (ZMQ client, HTTP gateway) for the ITL ratio")
    p.add_argument("--memory-requests", type=int, default=2000)
    p.add_argument("--memory-concurrency", type=int, default=16)
    p.add_argument("--long-lens", type=_ints, default=[8192, 32768], help="long: prompt lengths, one at a time")
    p.add_argument("--long-gen", type=int, default=128, help="long: new tokens per prompt")
    p.add_argument("--long-warm", action="store_true",
                   help="long: warm each side with one prompt of every length first (other tokens), so the timed "
                        "prefill excludes first-use kernel and attention-graph builds")
    p.add_argument("--mixed-requests", type=int, default=300, help="mixed: requests of the main part")
    p.add_argument("--mixed-rate", type=float, default=30.0, help="mixed: Poisson arrival rate, requests/s")
    p.add_argument("--mixed-prompt-median", type=int, default=400, help="mixed: lognormal prompt length median")
    p.add_argument("--mixed-prompt-max", type=int, default=3000, help="mixed: longest prompt (shortest: 16)")
    p.add_argument("--mixed-gen", type=_ints, default=[32, 384], help="mixed: min,max new tokens (uniform)")
    p.add_argument("--mixed-prefix-requests", type=int, default=64,
                   help="mixed: requests of the shared-prefix wave after the main part")
    p.add_argument("--mixed-prefix-len", type=int, default=2000, help="mixed: shared system prompt tokens")
    p.add_argument("--mixed-prefix-suffix", type=_ints, default=[16, 64],
                   help="mixed: min,max tokens of each wave request's own after the shared prefix (uniform)")
    p.add_argument("--mixed-stop-at-eos", action="store_true",
                   help="mixed: replies stop at EOS (else EOS is banned on both sides with logit_bias, so every "
                        "reply is max_tokens long and the sides do the same work)")
    p.add_argument("--mixed-runtime-only", action="store_true",
                   help="mixed: skip mlx_lm.server (a diagnostic re-run; the ratios need both sides)")
    p.add_argument("--goodput-ttft-ms", type=float, default=1000.0, help="mixed: goodput's TTFT target")
    p.add_argument("--goodput-tpot-ms", type=float, default=50.0, help="mixed: goodput's time-per-output-token target")
    p.add_argument("--mlx-server-concurrency", type=int, default=128,
                   help="mixed: mlx_lm.server --decode-concurrency")
    p.add_argument("--max-step-tokens", type=int, default=0,
                   help="runtime [scheduler] max_step_tokens (0: the service's default)")
    p.add_argument("--prefill-chunk", type=int, default=0,
                   help="runtime [scheduler] prefill_chunk (0: the service's default)")
    p.add_argument("--kv-slots", type=int, default=0,
                   help="runtime [cache] kv_slots; 0: just enough for the workloads (a service's default pool is "
                        "a share of device memory, far larger)")
    p.add_argument("--service-defaults", action="store_true",
                   help="first: leave max_running, max_context and kv_slots out of the config, so the service "
                        "sizes itself for its device as a user's would (the start-up a user meets)")
    p.add_argument("--mlx-prefill-batch", type=int, default=8, help="mlx-lm BatchGenerator prefill_batch_size")
    p.add_argument("--blas", choices=("auto", "bundled"), default="auto",
                   help="runtime [worker] blas; the bench process (mlx-lm) is re-run with the same BLAS")
    p.add_argument("--fuse-projections", choices=("auto", "on", "off"), default="auto",
                   help="runtime [worker] fuse_projections (auto: on a GPU)")
    p.add_argument("--seed", type=int, default=0, help="prompt and synthetic-weight seed")
    p.add_argument("--repeats", type=int, default=1,
                   help="run the runtime and mlx-lm phases this many times, alternating; tables show medians")
    p.add_argument("--json", type=Path, help="write every number to this file")
    return p


def _same_blas_as_worker(argv: list[str], mode: str) -> None:
    """Re-exec this process with the environment the runtime gives its worker.

    On Linux the runtime preloads a system OpenBLAS into the worker (``[worker] blas =
    "auto"``), which makes float32 matmuls many times faster than the BLAS bundled with
    the mlx-cpu wheel; mlx-lm runs in this process, so it must get the same library for
    the comparison to be fair.
    """
    if os.environ.get("RUNTIME_BENCH_REEXEC"):
        return
    try:
        from runtime.scheduler.blas import worker_env
    except ImportError:
        return
    env = worker_env(mode, dict(os.environ))
    if env.get("LD_PRELOAD", "") == os.environ.get("LD_PRELOAD", ""):
        return
    env["RUNTIME_BENCH_REEXEC"] = "1"
    env["RUNTIME_BENCH_COMMAND"] = " ".join(getattr(sys, "orig_argv", sys.argv))
    sys.stdout.flush()
    sys.stderr.flush()
    os.execve(sys.executable, [sys.executable, "-m", "runtime.bench", *argv], env)


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """Run the chosen workloads; services are always torn down on the way out."""
    from runtime.bench import phases, pinning, prefix_memory, workloads
    from runtime.bench.measure import Progress
    from runtime.bench.models import model_vocab, synthetic_model
    from runtime.bench.report import format_header, header, loadavg, write_json
    from runtime.bench.service import Service, gpu_memory_bytes, rss_bytes

    log = Progress()
    hdr = header()
    print(format_header(hdr), flush=True)
    work = args.work_dir
    if args.synthetic:
        model = synthetic_model(args.synthetic, work, seed=args.seed, log=log, tokenizer=args.synthetic_tokenizer)
    else:
        model = args.model.expanduser().resolve()
        if not (model / "config.json").exists():
            print(f"runtime bench: no config.json in {model}", file=sys.stderr)
            return 2
    vocab, eos = model_vocab(model)
    hdr["model"] = {"path": str(model), "synthetic": args.synthetic, "vocab_size": vocab}
    print(f"model:    {model}" + (f" (synthetic {args.synthetic})" if args.synthetic else ""), flush=True)
    bench = workloads.Bench(model, vocab, eos, args.seed, log, mlx_prefill_batch=args.mlx_prefill_batch)
    results: dict[str, Any] = {"header": hdr, "workloads": {}}
    warnings: list[str] = []
    chosen = [w for w in WORKLOADS if w in args.workloads]

    def report(name: str, outcome: workloads.Outcome) -> None:
        results["workloads"][name] = outcome.data
        warnings.extend(outcome.warnings)
        for tab in outcome.tables:
            print("\n" + tab, flush=True)
        for w in outcome.warnings:
            print("\n" + "!" * 78 + f"\n{w}\n" + "!" * 78, flush=True)
            print(w, file=sys.stderr, flush=True)

    plans: list[Any] = []
    if "single" in chosen:
        plans.append(workloads.Single(bench, args.prompt_len, args.gen_len, args.repeats))
    if "sweep" in chosen:
        plans.append(workloads.Sweep(bench, args.concurrency, args.prompt_len, args.gen_len, args.repeats))
    if "sampling" in chosen:
        from runtime.bench.sampling import Sampling

        plans.append(Sampling(bench, args.sampling_streams, args.prompt_len, args.gen_len, args.sampling_rounds))
    if "structured" in chosen:
        from runtime.bench.structured import Structured

        plans.append(Structured(bench, args.sampling_streams, args.prompt_len, args.gen_len, args.sampling_rounds))
    if "long" in chosen:
        from runtime.bench.long_prompt import LongPrompt

        plans.append(LongPrompt(bench, args.long_lens, args.long_gen, args.repeats, args.long_warm))
    if "prefix" in chosen:
        unique = (args.prefix_unique[0], args.prefix_unique[-1])
        plans.append(prefix_memory.Prefix(bench, args.prefix_requests, args.prefix_len, unique, args.prefix_gen,
                                                 args.repeats))
    services: dict[str, Any] = {}
    results["services"] = services
    if plans:
        for rep in range(args.repeats):
            if args.repeats > 1:
                log(f"repeat {rep + 1} of {args.repeats}")
            phases.runtime_phase(args, model, plans, services, rep, log)
            if any(plan.name not in ("sampling", "structured") for plan in plans):  # these compare the runtime with itself
                phases.mlx_phase(model, plans, rep, log)
        for plan in plans:
            report(plan.name, plan.outcome())
    if "paired" in chosen:
        report("paired", phases.paired_phase(args, model, bench, services, log))
    if "first" in chosen:
        report("first", phases.first_phase(args, model, bench, services, log))
    if "memory" in chosen:
        spec = phases.service_spec(args, model, ["memory"], cache=True)
        log("starting a fresh runtime for the memory workload")
        with Service(spec, work / "configs" / "memory.toml") as svc:
            services["memory"] = vars(spec) | {"model": str(model)}
            log(svc.banner)
            worker = svc.worker_pid()
            log(f"worker pid {worker}, scheduler pid {svc.pid}")

            def probe() -> dict[str, int | None]:
                gpu = gpu_memory_bytes()
                return {
                    "worker": rss_bytes(worker) if worker else None,
                    "scheduler": rss_bytes(svc.pid),
                    "worker_gpu": gpu.get(worker) if gpu is not None and worker else None,
                }

            report("memory", prefix_memory.memory(
                bench, svc.address, probe, args.memory_requests, args.memory_concurrency, phases.MEMORY_PROMPT, phases.MEMORY_GEN,
            ))
    if "http" in chosen:
        from runtime.bench.http import Http
        from runtime.bench.http_side import wait_http

        n = args.http_streams
        seq = args.prompt_len + args.gen_len
        spec = phases.service_spec(args, model, [], cache=True)
        spec = dataclasses.replace(spec, max_running=max(spec.max_running, n), max_context=max(spec.max_context, seq + 16),
                                   kv_slots=args.kv_slots or n * (seq + 16) + 4 * seq, http_port=args.http_port,
                                   http_workers=args.http_workers)
        split = pinning.split_cpus() if args.pin_clients else None
        if args.pin_clients:
            log(f"http: service on CPUs {sorted(split[0])}, clients on {sorted(split[1])}" if split
                else "http: --pin-clients: fewer than 4 physical cores, nothing pinned")
        log("starting a runtime with the HTTP gateway")
        with Service(spec, work / "configs" / "http.toml", cpus=split[0] if split else None) as svc:
            services["http"] = vars(spec) | {"model": str(model)}
            url = f"http://127.0.0.1:{args.http_port}"
            wait_http(url, svc)
            log(svc.banner)
            with pinning.pinned(split[1] if split else None):  # the bench's clients and their processes
                report("http", Http(bench, n, args.prompt_len, args.gen_len, args.http_pairs).run(svc.address, url, svc.pid))
    if "mixed" in chosen:
        report("mixed", phases.mixed_phase(args, model, bench, services, log))
    results["warnings"] = warnings
    results["loadavg_end"] = loadavg()
    print(f"\nload average at the end: {results['loadavg_end']} (at start: {hdr['loadavg_start']})", flush=True)
    if args.json:
        write_json(args.json, results)
        log(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``runtime bench`` and ``python -m runtime.bench``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--"]:
        argv = argv[1:]  # `runtime bench -- --synthetic tiny`: the CLI hands the separator on
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.synthetic and args.synthetic_tokenizer == "bytes" and "mixed" in args.workloads:
        # mixed sends text: each id above 255 comes back as several byte tokens (prompts ~7x longer)
        parser.error("the mixed workload needs the words tokenizer (its text prompts re-tokenize to other "
                     "lengths with --synthetic-tokenizer bytes); run it in a separate bench without that flag")
    _same_blas_as_worker(argv, args.blas)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    from runtime.bench.service import ServiceError

    try:
        return run(args)
    except ServiceError as exc:
        print(f"runtime bench: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("runtime bench: interrupted; services stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
