"""Start and stop the gateway process from ``runtime up``.

``bind`` takes the HTTP port before the model loads (a busy port is a one-line error);
``start`` hands the socket to ``python -m runtime.gateway.main`` in the same process group
and waits until ``/health`` answers 200. ``stop`` terminates it, then kills it.
"""

from __future__ import annotations

import asyncio
import socket
import subprocess
import sys
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
    """A running gateway; its stdin pipe is how it notices this process is gone."""

    def __init__(self, proc: subprocess.Popen, url: str) -> None:
        self.proc = proc
        self.url = url

    @classmethod
    async def start(cls, http: HttpConfig, sock: socket.socket, settings: GatewaySettings,
                    timeout_s: float = 60.0) -> GatewayProcess:
        """Spawn the gateway on ``sock`` (closed here once handed over) and wait for /health 200."""
        host = sock.getsockname()[0]
        url = f"http://{f'[{host}]' if ':' in host else host}:{http.port}"
        proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.gateway.main", "--settings", settings.to_json(),
             "--fd", str(sock.fileno())],
            stdin=subprocess.PIPE,
            pass_fds=(sock.fileno(),),
        )
        sock.close()
        gateway = cls(proc, url)
        try:
            await gateway._wait_healthy(timeout_s)
        except BaseException:
            await gateway.stop()
            raise
        return gateway

    async def _wait_healthy(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        last = "no answer"
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise GatewayError(f"the HTTP gateway exited during start-up (status {self.proc.returncode})")
            # The socket already listens, so this waits in the backlog until the app serves it.
            status, last = await asyncio.to_thread(_get_health, self.url + "/health", deadline - time.monotonic())
            if status == 200:
                return
            await asyncio.sleep(HEALTH_RETRY_S)  # 503: the scheduler's worker is not up yet
        raise GatewayError(f"the HTTP gateway did not become healthy within {timeout_s:.0f} s ({last})")

    async def stop(self) -> None:
        """SIGTERM, then SIGKILL after STOP_TIMEOUT_S; closing stdin also tells it to exit."""
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                await asyncio.to_thread(self.proc.wait, STOP_TIMEOUT_S)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                await asyncio.to_thread(self.proc.wait)


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
