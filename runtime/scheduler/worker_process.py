"""Start, watch and stop the MLX worker process."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from runtime.config import Config, config_to_dict
from runtime.scheduler.blas import worker_env


class WorkerProcess:
    """The worker as a child process connected to ``address`` (a PAIR socket the scheduler binds)."""

    def __init__(self, config: Config, address: str) -> None:
        self.config = config
        self.address = address
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        env = worker_env(self.config.worker.blas, dict(os.environ))
        cmd = [
            sys.executable,
            "-m",
            "runtime.worker.main",
            "--address",
            self.address,
            "--config-json",
            json.dumps(config_to_dict(self.config)),
        ]
        self.proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def exit_code(self) -> int | None:
        """None while running; the exit status once it has exited."""
        return None if self.proc is None else self.proc.poll()

    def kill(self) -> None:
        """SIGKILL now (also ends a stopped or hung process, which SIGTERM cannot) and reap it."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            pass
        self.proc = None

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for a clean exit, then terminate, then kill."""
        if self.proc is None:
            return
        for action in (None, self.proc.terminate, self.proc.kill):
            if action is not None and self.proc.poll() is None:
                action()
            try:
                self.proc.wait(timeout=timeout if action is None else 2.0)
                break
            except subprocess.TimeoutExpired:
                continue
        self.proc = None
