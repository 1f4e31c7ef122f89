"""``runtime up``: start the scheduler (this process), its worker and the HTTP gateway, serve
until SIGINT or SIGTERM, then stop them all.

Checks that need no model run first (config, model folder, addresses, ports), so a bad start
fails in seconds. The worker is launched before the tokenizer loads, and the HTTP gateway
right after (it answers "starting" until the worker is ready); a signal stops the service at
any point, start-up included.
"""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from typing import TYPE_CHECKING

from runtime.config import Config, ConfigError, load_config
from runtime.heap import freeze_startup_heap
from runtime.import_guard import keep_torch_out

if TYPE_CHECKING:
    from runtime.gateway.process import GatewayProcess
    from runtime.scheduler.server import Server


def up(config_path: str) -> int:
    """Run the service of the config file at ``config_path`` until SIGINT/SIGTERM; the exit status."""
    try:
        config = load_config(config_path)
    except ConfigError as exc:
        print(f"runtime: {exc}", file=sys.stderr)
        return 2
    if not os.path.isdir(config.model.path):
        print(f"runtime: no such folder: {config.model.path} (model.path in {config_path})", file=sys.stderr)
        return 1
    from runtime.protocol.security import SecurityError, check_bind_allowed
    from runtime.scheduler.addresses import AddressError, resolve

    addresses = resolve(config.server.address, config.server.host)
    try:
        check_bind_allowed(addresses.client, config.server)  # before the heavy imports
    except SecurityError as exc:
        addresses.cleanup()
        print(f"runtime: {exc}", file=sys.stderr)
        return 1
    http_socket = None
    if config.http is not None:
        from runtime.gateway.process import GatewayError, bind

        try:
            http_socket = bind(config.http)  # a busy port fails here, before the model loads
        except GatewayError as exc:
            addresses.cleanup()
            print(f"runtime: {exc}", file=sys.stderr)
            return 1
    keep_torch_out()  # before the tokenizer's imports (transformers would import it)
    from runtime.scheduler.server import Server

    try:
        import uvloop

        uvloop.install()
    except ImportError:  # uvloop is optional on platforms without it
        pass

    async def run() -> int:
        # SIGINT / SIGTERM stop the service from here on, start-up included (a GPU worker's
        # warm-up can take minutes); a terminal's Ctrl-C reaches the worker too, which ignores it.
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        try:
            server = Server(config, addresses)
        except (SecurityError, AddressError) as exc:
            print(f"runtime: {exc}", file=sys.stderr)
            return 1
        except Exception as exc:
            print(f"runtime: cannot load the tokenizer from {config.model.path}: {exc}", file=sys.stderr)
            return 1
        print(f"runtime: starting the worker for {config.model.path} (pid {server.supervisor.pid}); "
              "Ctrl-C stops", flush=True)
        gateway = None
        if http_socket is not None:  # answers "starting" while the worker loads
            from runtime.gateway.process import GatewayProcess, settings_for

            try:
                gateway = GatewayProcess.spawn(config.http, http_socket, settings_for(config, addresses.client))
            except OSError as exc:
                print(f"runtime: cannot start the HTTP gateway: {exc}", file=sys.stderr)
                await server.shutdown()
                return 1
        try:
            return await _serve(config, server, gateway, stop)
        finally:
            if gateway is not None:
                await gateway.stop()

    try:
        return asyncio.run(run())
    finally:
        if http_socket is not None:
            http_socket.close()
        addresses.cleanup()


async def _serve(config: Config, server: Server, gateway: GatewayProcess | None, stop: asyncio.Event) -> int:
    """Wait for the worker, announce the service, serve until ``stop``; the exit status."""
    from runtime.protocol.security import SecurityError
    from runtime.scheduler.addresses import AddressError
    from runtime.scheduler.server import WorkerStartError

    starting = asyncio.create_task(server.start())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not starting.done():  # stopped before the worker was ready
        starting.cancel()
        await asyncio.gather(starting, return_exceptions=True)
        await server.shutdown()
        print("runtime: stopped during start-up", flush=True)
        return 0
    try:
        starting.result()
    except (SecurityError, AddressError) as exc:
        print(f"runtime: {exc}", file=sys.stderr)
        await server.shutdown()
        return 1
    except WorkerStartError as exc:
        print(f"runtime: the worker could not load the model: {exc}", file=sys.stderr)
        await server.shutdown()
        return 1
    ready = server.ready
    assert ready is not None
    freeze_startup_heap()  # the tokenizer's and transformers' objects, out of the collector's way
    if ready.limits:  # before the "serving" line, which tells scripts the service is up
        print(f"runtime: limits: {ready.limits}", flush=True)
    print(
        f"runtime: serving {config.model.path} ({ready.model_type}, {ready.num_slots} KV slots "
        f"{ready.dtype} {(ready.pool_bytes + ready.aux_bytes) / 2**20:.1f} MiB, context {ready.max_context}) "
        f"on {server.addresses.client}",
        flush=True,
    )
    serve = asyncio.create_task(server.serve_forever())
    stopper = asyncio.create_task(stop.wait())
    code = 0
    if gateway is not None:
        code = await _gateway_healthy(gateway, stop)
    done, _ = await asyncio.wait({serve, stopper}, return_when=asyncio.FIRST_COMPLETED)
    if serve in done and serve.exception() is not None:
        print(f"runtime: stopped: {serve.exception()}", file=sys.stderr)
        code = 1
    if gateway is not None:  # HTTP first, while the scheduler still answers its in-flight requests
        await gateway.stop()
    serve.cancel()
    stopper.cancel()
    await server.shutdown()
    print("runtime: stopped", flush=True)
    return code


async def _gateway_healthy(gateway: GatewayProcess, stop: asyncio.Event) -> int:
    """Wait until the gateway (started with the worker) answers /health 200, then say where it
    serves; on failure print why and set ``stop``. The exit status so far."""
    from runtime.gateway.process import GatewayError

    healthy = asyncio.create_task(gateway.wait_healthy())
    stopper = asyncio.create_task(stop.wait())
    await asyncio.wait({healthy, stopper}, return_when=asyncio.FIRST_COMPLETED)
    stopper.cancel()
    if not healthy.done():  # SIGINT/SIGTERM first
        healthy.cancel()
        await asyncio.gather(healthy, return_exceptions=True)
        return 0
    if isinstance(healthy.exception(), GatewayError):
        print(f"runtime: {healthy.exception()}", file=sys.stderr)
        stop.set()
        return 1
    healthy.result()
    print(f"runtime: HTTP on {gateway.url}", flush=True)
    return 0
