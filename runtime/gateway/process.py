"""Start and stop the gateway process from ``runtime up``.

``bind`` takes the HTTP port before the model loads (a busy port is a one-line error);
``spawn`` hands the socket to ``[http] workers`` processes of ``python -m runtime.gateway.main``
in the same process group (each accepts on it: the kernel spreads the connections) while the
worker still loads, so the port answers (``starting``) from the first seconds; ``wait_healthy``
waits until ``/health`` answers 200 once the scheduler serves. ``stop`` terminates them, then
kills them.
"""

from __future__ import annotations

import asyncio
import dataclasses
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from runtime.config import Config, HttpConfig
from runtime.gateway.settings import GatewaySettings

STOP_TIMEOUT_S = 5.0
HEALTH_RETRY_S = 0.1


class GatewayError(RuntimeError):
    """The gateway could not start; the message says why, in one line."""


def bind(http: HttpConfig) -> socket.socket:
    """A listening socket on ``http.address``; GatewayError when it is taken or not local."""
    host, port = http.host, http.port
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except socket.gaierror as exc:
        raise GatewayError(f"http.address {http.address!r}: unknown host ({exc.strerror})") from None
    family, _, _, _, sockaddr = infos[0]
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(sockaddr)
        sock.listen(2048)
    except OSError as exc:
        sock.close()
        raise GatewayError(f"cannot listen on http.address {http.address}: {exc.strerror}") from None
    return sock


class GatewayProcess:
    """The running gateway processes; a stdin pipe each is how they notice this process is gone."""

    def __init__(self, procs: list[subprocess.Popen], url: str, metrics_dir: str | None = None) -> None:
        self.procs = procs
        self.url = url
        self.metrics_dir = metrics_dir
        self.stopped = False

    @classmethod
    def spawn(cls, http: HttpConfig, sock: socket.socket, settings: GatewaySettings) -> GatewayProcess:
        """Start the gateway processes on ``sock`` (closed here once handed over); they answer
        ``starting`` until the scheduler serves."""
        host = sock.getsockname()[0]
        url = f"http://{f'[{host}]' if ':' in host else host}:{http.port}"
        env, metrics_dir = None, None
        if http.workers > 1:  # prometheus-client's multiprocess mode: one directory of files for all
            metrics_dir = tempfile.mkdtemp(prefix="runtime-gateway-metrics-")
            settings = dataclasses.replace(settings, metrics_dir=metrics_dir)
            env = {**os.environ, "PROMETHEUS_MULTIPROC_DIR": metrics_dir}
        command = [sys.executable, "-m", "runtime.gateway.main", "--settings", settings.to_json(),
                   "--fd", str(sock.fileno())]
        procs: list[subprocess.Popen] = []
        try:
            for _ in range(http.workers):
                procs.append(subprocess.Popen(command, stdin=subprocess.PIPE, pass_fds=(sock.fileno(),), env=env))
        except BaseException:
            for proc in procs:
                proc.kill()
            raise
        finally:
            sock.close()
        return cls(procs, url, metrics_dir)

    async def wait_healthy(self, timeout_s: float = 60.0) -> None:
        """Until ``/health`` answers 200 (GatewayError if a process exits or ``timeout_s`` passes)."""
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            for proc in self.procs:
                if proc.poll() is not None:
                    raise GatewayError(f"the HTTP gateway exited during start-up (status {proc.returncode})")
            # The socket already listens, so this waits in the backlog until the app serves it.
            status, last = await asyncio.to_thread(_get_health, self.url + "/health", deadline - time.monotonic())
            if status == 200:
                return
            await asyncio.sleep(HEALTH_RETRY_S)  # 503: starting, or the scheduler's worker is not up yet
        raise GatewayError(f"the HTTP gateway did not become healthy within {timeout_s:.0f} s ({last})")

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; closing stdin also tells them to exit.
        Once: ``runtime up`` stops the gateway before the scheduler, and again on every way out."""
        if self.stopped:
            return
        self.stopped = True
        await asyncio.gather(*(_stop(proc) for proc in self.procs))
        if self.metrics_dir is not None:
            shutil.rmtree(self.metrics_dir, ignore_errors=True)


async def _stop(proc: subprocess.Popen) -> None:
    if proc.stdin is not None:
        proc.stdin.close()
    if proc.poll() is None:
        proc.terminate()
        try:
            await asyncio.to_thread(proc.wait, STOP_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            await asyncio.to_thread(proc.wait)


def _get_health(url: str, timeout_s: float) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=max(timeout_s, 0.1)) as reply:
            return reply.status, "ok"
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read().decode(errors="replace")[:200]
    except (urllib.error.URLError, OSError) as exc:
        return 0, str(exc)


def settings_for(config: Config, scheduler_address: str) -> GatewaySettings:
    """What the gateway process needs from the service's config (CURVE: the server's public key)."""
    assert config.http is not None
    server_key = None
    if config.server.curve_secret_key:
        import zmq

        server_key = zmq.curve_public(config.server.curve_secret_key.encode()).decode()
    return GatewaySettings(scheduler_address=scheduler_address, model_path=config.model.path,
                           served_model_name=config.http.served_model_name, api_keys=tuple(config.http.api_keys),
                           server_key=server_key)


__all__ = ["GatewayError", "GatewayProcess", "bind", "settings_for"]
