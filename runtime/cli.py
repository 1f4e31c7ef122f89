"""``runtime`` command line: up, status, generate, bench."""

from __future__ import annotations

import argparse
import asyncio
import json
import signal
import sys

from runtime.config import ConfigError, load_config
from runtime.heap import freeze_startup_heap


def _cmd_up(args: argparse.Namespace) -> int:
    try:
        config = load_config(args.config)
    except ConfigError as exc:
        print(f"runtime: {exc}", file=sys.stderr)
        return 2
    from runtime.scheduler.addresses import resolve
    from runtime.scheduler.server import Server, WorkerStartError

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional on platforms without it
        pass
    addresses = resolve(config.server.address, config.server.host)

    async def run() -> int:
        try:
            server = Server(config, addresses)
        except Exception as exc:
            print(f"runtime: cannot load the tokenizer from {config.model.path}: {exc}", file=sys.stderr)
            return 1
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            await server.start()
        except WorkerStartError as exc:
            print(f"runtime: the worker could not load the model: {exc}", file=sys.stderr)
            await server.shutdown()
            return 1
        ready = server.ready
        assert ready is not None
        freeze_startup_heap()  # the tokenizer's and transformers' objects, out of the collector's way
        print(
            f"runtime: serving {config.model.path} ({ready.model_type}, {ready.num_slots} KV slots "
            f"{ready.dtype} {(ready.pool_bytes + ready.aux_bytes) / 2**20:.1f} MiB, context {ready.max_context}) "
            f"on {addresses.client}",
            flush=True,
        )
        serve = asyncio.create_task(server.serve_forever())
        stopper = asyncio.create_task(stop.wait())
        done, _ = await asyncio.wait({serve, stopper}, return_when=asyncio.FIRST_COMPLETED)
        code = 0
        if serve in done and serve.exception() is not None:
            print(f"runtime: stopped: {serve.exception()}", file=sys.stderr)
            code = 1
        serve.cancel()
        stopper.cancel()
        await server.shutdown()
        print("runtime: stopped", flush=True)
        return code

    try:
        return asyncio.run(run())
    finally:
        addresses.cleanup()


def _cmd_status(args: argparse.Namespace) -> int:
    from runtime.client import ServiceUnavailable, SyncClient

    with SyncClient(args.address) as client:
        try:
            reply = client.status(timeout=args.timeout)
        except ServiceUnavailable as exc:
            print(f"runtime: {exc}", file=sys.stderr)
            return 1
    facts = {k: getattr(reply, k) for k in reply.__struct_fields__ if k != "rid"}
    for key, value in facts.items():
        print(f"{key}: {value}")
    return 0


def _cmd_generate(args: argparse.Namespace) -> int:
    from runtime.client import RequestFailed, ServiceUnavailable, SyncClient

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    with SyncClient(args.address, timeout_s=args.timeout) as client:
        try:
            if args.json:
                result = client.generate(args.prompt, **kwargs)
                print(
                    json.dumps(
                        {
                            "token_ids": result.token_ids,
                            "text": result.text,
                            "finish_reason": result.finish_reason,
                            "prompt_tokens": result.prompt_tokens,
                            "cached_tokens": result.cached_tokens,
                            **({"error": result.error} if result.error else {}),
                        }
                    )
                )
                return 1 if result.finish_reason == "error" else 0
            for chunk in client.stream(args.prompt, **kwargs):
                sys.stdout.write(chunk.text)
                sys.stdout.flush()
            sys.stdout.write("\n")
            return 0
        except RequestFailed as exc:
            print(f"\nruntime: request failed: {exc}", file=sys.stderr)
            return 1
        except ServiceUnavailable as exc:
            print(f"runtime: {exc}", file=sys.stderr)
            return 1


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["bench"]:
        # The bench has its own parser; hand it everything after `bench`, flags included.
        from runtime.bench.main import main as bench_main

        rest = argv[1:]
        return bench_main(rest[1:] if rest[:1] == ["--"] else rest)
    parser = argparse.ArgumentParser(prog="runtime", description="LLM serving runtime on MLX")
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="start the service")
    up.add_argument("-c", "--config", required=True, help="TOML config file")
    up.set_defaults(func=_cmd_up)
    st = sub.add_parser("status", help="print model and queue facts of a running service")
    st.add_argument("-a", "--address", required=True)
    st.add_argument("--timeout", type=float, default=3.0)
    st.set_defaults(func=_cmd_status)
    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("-a", "--address", required=True)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the whole result")
    gen.add_argument("--timeout", type=float, default=None, help="seconds to wait for each reply")
    gen.add_argument("prompt")
    gen.set_defaults(func=_cmd_generate)
    sub.add_parser("bench", help="benchmark against mlx-lm on the same model (runtime bench --help)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
