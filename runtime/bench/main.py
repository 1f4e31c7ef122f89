"""``runtime bench``: argument parsing and the run itself (services up, workloads, report)."""

from __future__ import annotations

import argparse
import contextlib
import signal
import sys
from pathlib import Path
from typing import Any

WORKLOADS = ("single", "sweep", "prefix", "memory")
DEFAULT_WORKLOADS = "single,sweep,prefix"
MEMORY_PROMPT = (8, 200)
MEMORY_GEN = (1, 64)


def _ints(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError(f"expected positive integers, got {text!r}")
    return values


def _workloads(text: str) -> list[str]:
    names = [w.strip() for w in text.split(",") if w.strip()]
    if names == ["all"]:
        return list(WORKLOADS)
    bad = [w for w in names if w not in WORKLOADS]
    if bad or not names:
        raise argparse.ArgumentTypeError(f"unknown workloads {bad}; choose from {', '.join(WORKLOADS)} or 'all'")
    return names


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="runtime bench",
        description="Benchmark the runtime against mlx-lm on the same model in the same run.",
    )
    src = p.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="an existing mlx-lm model folder")
    src.add_argument("--synthetic", choices=("tiny", "llama-1b", "llama-8b"), help="a random-weight model shape")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/runtime-bench"), help="synthetic models, configs")
    p.add_argument("--workloads", type=_workloads, default=_workloads(DEFAULT_WORKLOADS),
                   help=f"comma list of {', '.join(WORKLOADS)} or 'all' (default {DEFAULT_WORKLOADS})")
    p.add_argument("--prompt-len", type=int, default=256, help="single and sweep prompt tokens")
    p.add_argument("--gen-len", type=int, default=256, help="single and sweep new tokens")
    p.add_argument("--concurrency", type=_ints, default=[1, 4, 16, 64, 256], help="sweep levels, e.g. 1,4,16")
    p.add_argument("--prefix-requests", type=int, default=32)
    p.add_argument("--prefix-len", type=int, default=1024)
    p.add_argument("--prefix-unique", type=_ints, default=[16, 64], help="min,max unique tokens per request")
    p.add_argument("--prefix-gen", type=int, default=32)
    p.add_argument("--memory-requests", type=int, default=2000)
    p.add_argument("--memory-concurrency", type=int, default=16)
    p.add_argument("--max-step-tokens", type=int, default=2048, help="runtime [scheduler] max_step_tokens")
    p.add_argument("--prefill-chunk", type=int, default=512, help="runtime [scheduler] prefill_chunk")
    p.add_argument("--mlx-prefill-batch", type=int, default=8, help="mlx-lm BatchGenerator prefill_batch_size")
    p.add_argument("--seed", type=int, default=0, help="prompt and synthetic-weight seed")
    p.add_argument("--json", type=Path, help="write every number to this file")
    return p


def _service_spec(args: argparse.Namespace, model: Path, workloads: list[str], cache: bool) -> Any:
    """Limits that fit every request of the chosen workloads, with a little slack."""
    from runtime.bench.service import ServiceSpec

    running, context, slots = 1, 64, 0
    if "single" in workloads or "sweep" in workloads:
        n = max(args.concurrency) if "sweep" in workloads else 1
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
    return ServiceSpec(
        model=model,
        max_running=running,
        max_context=context + 16,
        kv_slots=slots + 2 * context + 64,
        cache_enabled=cache,
        max_step_tokens=args.max_step_tokens,
        prefill_chunk=args.prefill_chunk,
    )


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def run(args: argparse.Namespace) -> int:
    """Run the chosen workloads; services are always torn down on the way out."""
    from runtime.bench import prefix_memory, workloads
    from runtime.bench.measure import Progress
    from runtime.bench.models import model_vocab, synthetic_model
    from runtime.bench.report import format_header, header, write_json
    from runtime.bench.service import Service, rss_bytes

    log = Progress()
    hdr = header()
    print(format_header(hdr), flush=True)
    work = args.work_dir
    if args.synthetic:
        model = synthetic_model(args.synthetic, work, seed=args.seed, log=log)
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
    served = [w for w in chosen if w != "memory"]

    def report(name: str, outcome: workloads.Outcome) -> None:
        results["workloads"][name] = outcome.data
        warnings.extend(outcome.warnings)
        for tab in outcome.tables:
            print("\n" + tab, flush=True)
        for w in outcome.warnings:
            print("\n" + "!" * 78 + f"\n{w}\n" + "!" * 78, flush=True)
            print(w, file=sys.stderr, flush=True)

    with contextlib.ExitStack() as stack:
        if served:
            spec = _service_spec(args, model, served, cache=True)
            log(f"starting the runtime (cache on): {spec}")
            on = stack.enter_context(Service(spec, work / "configs" / "cache-on.toml"))
            log(on.banner)
            results["services"] = {"cache_on": vars(spec) | {"model": str(model)}}
            if "single" in chosen:
                report("single", workloads.single(bench, on.address, args.prompt_len, args.gen_len))
            if "sweep" in chosen:
                report("sweep", workloads.sweep(bench, on.address, args.concurrency, args.prompt_len, args.gen_len))
            if "prefix" in chosen:
                off_spec = _service_spec(args, model, ["prefix"], cache=False)
                log("starting the runtime (cache off)")
                with Service(off_spec, work / "configs" / "cache-off.toml") as off:
                    results["services"]["cache_off"] = vars(off_spec) | {"model": str(model)}
                    lo, hi = args.prefix_unique[0], args.prefix_unique[-1]
                    report(
                        "prefix",
                        prefix_memory.prefix(
                            bench, on.address, off.address, args.prefix_requests, args.prefix_len, (lo, hi),
                            args.prefix_gen,
                        ),
                    )
            stack.close()
        if "memory" in chosen:
            spec = _service_spec(args, model, ["memory"], cache=True)
            log("starting a fresh runtime for the memory workload")
            with Service(spec, work / "configs" / "memory.toml") as svc:
                results.setdefault("services", {})["memory"] = vars(spec) | {"model": str(model)}
                log(svc.banner)
                worker = svc.worker_pid()
                log(f"worker pid {worker}, scheduler pid {svc.pid}")

                def rss() -> dict[str, int | None]:
                    return {"worker": rss_bytes(worker) if worker else None, "scheduler": rss_bytes(svc.pid)}

                report(
                    "memory",
                    prefix_memory.memory(
                        bench, svc.address, rss, args.memory_requests, args.memory_concurrency,
                        MEMORY_PROMPT, MEMORY_GEN,
                    ),
                )
    results["warnings"] = warnings
    if args.json:
        write_json(args.json, results)
        log(f"wrote {args.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of ``runtime bench`` and ``python -m runtime.bench``."""
    args = build_parser().parse_args(argv)
    previous = signal.signal(signal.SIGTERM, _raise_interrupt)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("runtime bench: interrupted; services stopped", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
