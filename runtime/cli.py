"""``runtime`` command line: up, status, generate, keygen, bench."""

from __future__ import annotations

import argparse
import json
import os
import sys


def _cmd_up(args: argparse.Namespace) -> int:
    from runtime.up import up

    return up(args.config)


def _client_keys(args: argparse.Namespace) -> dict[str, str]:
    """The CURVE keyword arguments for SyncClient, checked here so a bad key fails before connecting."""
    from runtime.protocol.security import client_keys

    keys = {"server_key": args.server_key, "public_key": args.public_key, "secret_key": args.secret_key}
    client_keys(**keys)
    return {name: key for name, key in keys.items() if key}  # none given: a plain connection


def _cmd_status(args: argparse.Namespace) -> int:
    from runtime.client import ServiceUnavailable, SyncClient
    from runtime.protocol.security import SecurityError

    try:
        client = SyncClient(args.address, timeout_s=args.timeout, **_client_keys(args))
    except SecurityError as exc:
        print(f"runtime: {exc}", file=sys.stderr)
        return 2
    with client:
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
    from runtime.protocol.security import SecurityError

    kwargs = dict(max_tokens=args.max_tokens, temperature=args.temperature, ignore_eos=args.ignore_eos)
    for name in ("top_p", "top_k", "min_p", "seed", "min_tokens", "repetition_penalty",
                 "presence_penalty", "frequency_penalty"):
        if getattr(args, name) is not None:
            kwargs[name] = getattr(args, name)
    if args.stop:
        kwargs["stop"] = args.stop
    if args.chat:
        kwargs["messages"] = [{"role": "user", "content": args.prompt}]
    prompt = None if args.chat else args.prompt
    try:
        client = SyncClient(args.address, timeout_s=args.timeout, **_client_keys(args))
    except SecurityError as exc:
        print(f"runtime: {exc}", file=sys.stderr)
        return 2
    with client:
        try:
            if args.json:
                result = client.chat(kwargs.pop("messages"), **kwargs) if args.chat else client.generate(prompt, **kwargs)
                print(
                    json.dumps(
                        {
                            "token_ids": result.token_ids,
                            "text": result.text,
                            "finish_reason": result.finish_reason,
                            "prompt_tokens": result.prompt_tokens,
                            "cached_tokens": result.cached_tokens,
                            **({"stop_reason": result.stop_reason} if result.stop_reason is not None else {}),
                            **({"error": result.error} if result.error else {}),
                        }
                    )
                )
                return 1 if result.finish_reason == "error" else 0
            for chunk in client.stream(prompt, **kwargs):
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


def _cmd_keygen(args: argparse.Namespace) -> int:
    from runtime.protocol.security import generate_keypair

    public, secret = generate_keypair()
    if args.json:
        print(json.dumps({"public": public, "secret": secret}))
        return 0
    print(f"public: {public}")
    print(f"secret: {secret}")
    print("# in the service's config (keep it private); clients pass the public key as --server-key=PUBLIC:")
    print(f'[server]\ncurve_secret_key = "{secret}"')
    return 0


def _add_key_flags(parser: argparse.ArgumentParser) -> None:
    env = os.environ.get
    parser.add_argument(
        "--server-key",
        default=env("RUNTIME_SERVER_KEY"),
        metavar="Z85",
        help="the service's CURVE public key (default: $RUNTIME_SERVER_KEY); write --server-key=Z85, since a key "
             "may begin with '-'",
    )
    parser.add_argument(
        "--public-key",
        default=env("RUNTIME_PUBLIC_KEY"),
        metavar="Z85",
        help="this client's CURVE public key (default: $RUNTIME_PUBLIC_KEY; none: an ephemeral pair)",
    )
    parser.add_argument(
        "--secret-key",
        default=env("RUNTIME_SECRET_KEY"),
        metavar="Z85",
        help="this client's CURVE secret key (default: $RUNTIME_SECRET_KEY)",
    )


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
    _add_key_flags(st)
    st.set_defaults(func=_cmd_status)
    gen = sub.add_parser("generate", help="stream a completion")
    gen.add_argument("-a", "--address", required=True)
    gen.add_argument("--max-tokens", type=int, default=256)
    gen.add_argument("--temperature", type=float, default=0.0)
    gen.add_argument("--ignore-eos", action="store_true")
    gen.add_argument("--top-p", type=float, default=None)
    gen.add_argument("--top-k", type=int, default=None)
    gen.add_argument("--min-p", type=float, default=None)
    gen.add_argument("--seed", type=int, default=None)
    gen.add_argument("--min-tokens", type=int, default=None)
    gen.add_argument("--repetition-penalty", type=float, default=None)
    gen.add_argument("--presence-penalty", type=float, default=None)
    gen.add_argument("--frequency-penalty", type=float, default=None)
    gen.add_argument("--stop", action="append", default=[], help="a stop string (repeat for several)")
    gen.add_argument("--chat", action="store_true", help="send the prompt as a user message through the chat template")
    gen.add_argument("--json", action="store_true", help="print one JSON object with the whole result")
    gen.add_argument("--timeout", type=float, default=None, help="seconds to wait for each reply")
    gen.add_argument("prompt")
    _add_key_flags(gen)
    gen.set_defaults(func=_cmd_generate)
    keygen = sub.add_parser("keygen", help="print a new CURVE key pair for server.curve_secret_key")
    keygen.add_argument("--json", action="store_true", help='print {"public": ..., "secret": ...}')
    keygen.set_defaults(func=_cmd_keygen)
    sub.add_parser("bench", help="benchmark against mlx-lm on the same model (runtime bench --help)")
    args = parser.parse_args(argv)
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
