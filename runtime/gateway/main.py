"""Gateway process entry point: ``python -m runtime.gateway.main --settings JSON --fd N``.

Serves the app on the listening socket ``runtime up`` bound and passed down (so a busy port
fails there, before the model loads). Exits when its stdin closes: ``runtime up`` holds the
other end, so the gateway never outlives it, even when it is killed.
"""

from __future__ import annotations

import argparse
import asyncio
import socket
import sys
import threading

import uvicorn

from runtime.gateway.app import create_app
from runtime.gateway.settings import GatewaySettings

GRACEFUL_SHUTDOWN_S = 2


def _exit_when_parent_goes(server: uvicorn.Server, loop: asyncio.AbstractEventLoop) -> None:
    def watch() -> None:
        sys.stdin.buffer.read()  # returns at EOF: the parent closed its end or died
        loop.call_soon_threadsafe(setattr, server, "should_exit", True)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


async def _serve(settings: GatewaySettings, sock: socket.socket) -> None:
    config = uvicorn.Config(create_app(settings), log_level="warning", access_log=False, lifespan="on",
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S)
    server = uvicorn.Server(config)
    _exit_when_parent_goes(server, asyncio.get_running_loop())
    await server.serve(sockets=[sock])
    if not server.started:
        raise SystemExit(1)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="runtime-gateway", description="OpenAI-compatible HTTP gateway")
    parser.add_argument("--settings", required=True, help="GatewaySettings as JSON")
    parser.add_argument("--fd", type=int, required=True, help="a listening TCP socket's file descriptor")
    args = parser.parse_args(argv)
    settings = GatewaySettings.from_json(args.settings)
    sock = socket.socket(fileno=args.fd)
    try:
        import uvloop

        uvloop.install()
    except ImportError:
        pass
    asyncio.run(_serve(settings, sock))
    return 0


if __name__ == "__main__":
    sys.exit(main())
