"""The ranks of a tensor-parallel worker as one worker: started, watched and killed together.

``RankProcesses`` has ``WorkerProcess``'s interface, so the supervisor treats N ranks as one
worker: the worker is up while every rank runs; the first rank to exit makes the whole worker
dead (its exit status is the worker's), and a kill or stop ends every rank. A rank that hangs
stops rank 0 in a collective, so the step timeout catches it as it catches a hung worker.
Ranks on other hosts run under ``ssh -tt``: ending the ssh client hangs up the remote
terminal, which ends the rank there.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys

from runtime.config import Config
from runtime.scheduler.blas import worker_env
from runtime.scheduler.rank_launch import RankLaunch, plan_ranks
from runtime.scheduler.worker_process import WorkerProcess


def worker_process(config: Config, address: str) -> WorkerProcess | RankProcesses:
    """One process, or ``worker.tensor_parallel`` ranks acting as one."""
    if config.worker.tensor_parallel > 1:
        return RankProcesses(config, address)
    return WorkerProcess(config, address)


class RankProcesses:
    """Every rank's process (rank 0 first; ``procs`` empty while none is started).

    Invariant: either no rank is started, or every rank of one launch is (a restart starts a
    fresh group with fresh ports after ``kill`` reaped the old one).
    """

    def __init__(self, config: Config, address: str) -> None:
        self.config = config
        self.address = address
        self.procs: list[subprocess.Popen] = []
        self._told: set[int] = set()  # pids whose exit was logged

    def start(self) -> None:
        assert not self.procs, "kill or stop the ranks before starting them again"
        self._told.clear()
        workdir = self.address.removeprefix("ipc://").rsplit("/", 1)[0]
        for launch in plan_ranks(self.config, self.address):
            self.procs.append(self._spawn(launch, workdir))

    def _spawn(self, launch: RankLaunch, workdir: str) -> subprocess.Popen:
        if launch.local:
            env = worker_env(self.config.worker.blas, {**os.environ, **launch.env})
            for name, content in launch.files.items():
                path = os.path.join(workdir, f"{name.lower()}.json")
                with open(path, "w") as f:
                    f.write(content)
                env[name] = path
            return subprocess.Popen(launch.argv, env=env, stdin=subprocess.DEVNULL)
        return subprocess.Popen(["ssh", "-tt", "-o", "LogLevel=QUIET", launch.host.ssh, _remote_script(launch)],
                                stdin=subprocess.PIPE)

    @property
    def proc(self) -> subprocess.Popen | None:
        """Rank 0's process (the one the scheduler talks to)."""
        return self.procs[0] if self.procs else None

    @property
    def pid(self) -> int | None:
        return self.procs[0].pid if self.procs else None

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    def exit_code(self) -> int | None:
        """None while every rank runs; else the exit status of the first rank found exited."""
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None:
                if proc.pid not in self._told:
                    self._told.add(proc.pid)
                    print(f"runtime: worker rank {rank} (pid {proc.pid}) exited with status {code}",
                          file=sys.stderr, flush=True)
                return code
        return None

    def kill(self) -> None:
        """SIGKILL every rank now and reap them."""
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                pass
        self.procs = []

    def stop(self, timeout: float = 5.0) -> None:
        """Wait for every rank's clean exit (rank 0 passes Shutdown on), then terminate, then kill."""
        for action in (None, "terminate", "kill"):
            alive = [p for p in self.procs if p.poll() is None]
            if not alive:
                break
            for proc in alive:
                if action is not None:
                    getattr(proc, action)()
            for proc in alive:
                try:
                    proc.wait(timeout=timeout if action is None else 2.0)
                except subprocess.TimeoutExpired:
                    pass
        self.procs = []


def _remote_script(launch: RankLaunch) -> str:
    """A shell line for the rank's host: write its files, set its environment, run it."""
    parts = []
    for name, content in launch.files.items():
        parts.append(f"{name}=$(mktemp) && printf %s {shlex.quote(content)} > \"${name}\" && export {name}")
    parts.append(f"cd {shlex.quote(os.getcwd())}")
    env = " ".join(f"{k}={shlex.quote(v)}" for k, v in launch.env.items())
    parts.append(f"exec env {env} {shlex.join(launch.argv)}")
    return " && ".join(parts)
