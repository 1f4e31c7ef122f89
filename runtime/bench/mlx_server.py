"""Start and stop ``python -m mlx_lm.server`` for the bench: mlx-lm's own HTTP server as a baseline.

The server runs in its own process group (so nothing it starts outlives it), its output is
kept for the error message when it does not come up, and ``stop()`` always kills the group.
It inherits this process's environment, so it gets the same BLAS as the runtime's worker
(``runtime.bench.main._same_blas_as_worker``).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from pathlib import Path

from runtime.bench.service import Managed, ServiceError, end_group


def free_port() -> int:
    """A loopback TCP port nobody listens on right now (the OS picks it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


FIRST_ERROR_LINES = 60


class MlxServer(Managed):
    """``mlx_lm.server --model PATH --decode-concurrency N`` on 127.0.0.1, killed on exit."""

    def __init__(self, model: Path, decode_concurrency: int, port: int = 0, startup_timeout_s: float = 900.0) -> None:
        self.model, self.decode_concurrency = Path(model), decode_concurrency
        self.port = port
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.lines: deque[str] = deque(maxlen=200)
        self.first_error: list[str] = []  # the first traceback's lines: later ones may push it out of ``lines``

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        """The server's command line."""
        return [sys.executable, "-m", "mlx_lm.server", "--model", str(self.model), "--host", "127.0.0.1",
                "--port", str(self.port), "--decode-concurrency", str(self.decode_concurrency)]

    def start(self) -> None:
        """Launch the server and wait until its ``/health`` answers 200."""
        import httpx

        self.port = self.port or free_port()
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            self.command(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, text=True,
            env=env, start_new_session=True,
        )
        threading.Thread(target=self._drain, daemon=True).start()
        deadline = time.monotonic() + self.startup_timeout_s
        while True:
            if self.proc.poll() is not None:
                time.sleep(0.2)  # let the drain thread read the last lines
                raise ServiceError(f"mlx_lm.server exited during start-up (code {self.proc.returncode}):\n"
                                   f"{self.log()}")
            try:
                status = httpx.get(f"{self.url}/health", timeout=2.0, trust_env=False).status_code
            except httpx.HTTPError:
                status = 0  # not listening yet
            if status == 200:  # the model may still be loading: the warm-up waits for it
                return
            if status == 503:  # its generation thread died (the model did not load); it will not recover
                time.sleep(0.2)
                raise ServiceError(f"mlx_lm.server cannot generate (/health says 503):\n{self.log()}")
            if time.monotonic() > deadline:
                raise ServiceError(f"mlx_lm.server did not answer {self.url}/health within "
                                   f"{self.startup_timeout_s} s:\n{self.log()}")
            time.sleep(0.25)

    def _drain(self) -> None:
        proc = self.proc
        assert proc is not None and proc.stdout is not None
        for line in proc.stdout:
            if '"GET /health ' not in line:  # our own polls would push the useful lines out
                self.lines.append(line)
            if (self.first_error or line.startswith("Traceback")) and len(self.first_error) < FIRST_ERROR_LINES:
                self.first_error.append(line)

    def log(self) -> str:
        """The last lines the server printed."""
        return "".join(self.lines)

    def error(self) -> str:
        """The first traceback the server printed ("" if none)."""
        return "".join(self.first_error)

    def stop(self) -> None:
        """SIGTERM the server's process group, then SIGKILL whatever is left of it."""
        proc, self.proc = self.proc, None
        if proc is not None:
            end_group(proc, term_group=True)
