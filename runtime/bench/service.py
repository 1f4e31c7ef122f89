"""Start and stop ``runtime up`` services for the bench, and read their memory use."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
_SERVING = re.compile(r"runtime: serving .* on ((?:ipc|tcp)://\S+)")


@dataclass(frozen=True)
class ServiceSpec:
    """The config knobs the bench sets; everything else keeps the runtime's defaults."""

    model: Path
    max_running: int  # 0: left out of the config (the service's default for its device)
    max_context: int  # 0: left out (the model's own context, bounded by the pool)
    kv_slots: int  # 0: left out (a share of device memory)
    cache_enabled: bool = True
    max_step_tokens: int = 0  # 0: left out of the config, so the service picks its own default
    prefill_chunk: int = 0  # 0: likewise
    blas: str = "auto"
    fuse_projections: str = "auto"
    http_port: int = 0  # > 0: also serve HTTP (the gateway) on 127.0.0.1:http_port
    http_workers: int = 1  # [http] workers: gateway processes

    def toml(self) -> str:
        """The config file text (keys as in runtime/config/sections.py); any knob that is 0 is left out."""
        scheduler = [f"max_context = {self.max_context}"] if self.max_context else []
        if self.max_running:
            scheduler.append(f"max_running = {self.max_running}")
        # Left out, not written as 0: the service then picks the value measured best on its device.
        if self.max_step_tokens:
            scheduler.append(f"max_step_tokens = {self.max_step_tokens}")
        if self.prefill_chunk:
            scheduler.append(f"prefill_chunk = {self.prefill_chunk}")
        return (
            f"[model]\npath = {str(self.model)!r}\n\n"
            '[server]\naddress = "ipc://"\n\n'
            "[scheduler]\n" + "".join(line + "\n" for line in scheduler) + "\n"
            "[cache]\n"
            f"enabled = {'true' if self.cache_enabled else 'false'}\n"
            + (f"kv_slots = {self.kv_slots}\n" if self.kv_slots else "") + "\n"
            f"[worker]\nblas = {self.blas!r}\nfuse_projections = {self.fuse_projections!r}\n"
            + (f'\n[http]\naddress = "127.0.0.1:{self.http_port}"\n' if self.http_port else "")
            + (f"workers = {self.http_workers}\n" if self.http_port and self.http_workers != 1 else "")
        )


def end_group(proc: subprocess.Popen, term_group: bool) -> None:
    """SIGTERM ``proc`` (``term_group``: its whole process group), wait up to 10 s, then SIGKILL
    whatever is left of the group, so nothing outlives the bench."""
    try:
        if proc.poll() is None:
            (os.killpg(proc.pid, signal.SIGTERM) if term_group else proc.send_signal(signal.SIGTERM))
            proc.wait(timeout=10.0)
    except (subprocess.TimeoutExpired, ProcessLookupError, PermissionError):
        pass
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            proc.wait(timeout=10.0)
        except subprocess.TimeoutExpired:
            pass


class Managed:
    """A process started by ``start()`` and always stopped by ``stop()``: ``with X(...) as x:``
    stops it even when starting it fails half-way."""

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def __enter__(self):
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


class ServiceError(RuntimeError):
    """The service did not start; the message carries its output."""


class Service(Managed):
    """A ``python -m runtime.cli up`` process group, killed on ``stop()`` / context exit."""

    def __init__(self, spec: ServiceSpec, config_path: Path, startup_timeout_s: float = 900.0,
                 cpus: set[int] | None = None) -> None:
        self.spec = spec
        self.cpus = cpus  # the CPUs the service's processes may run on (None: any)
        self.config_path = config_path
        self.startup_timeout_s = startup_timeout_s
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.banner = ""
        self.lines: deque[str] = deque(maxlen=200)
        self._lines_q: queue.Queue = queue.Queue()

    def start(self) -> None:
        """Launch the service and wait for its "serving" line."""
        self.config_path.parent.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(self.spec.toml())
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO_ROOT), env.get("PYTHONPATH", "")) if p)
        env["PYTHONUNBUFFERED"] = "1"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "runtime.cli", "up", "-c", str(self.config_path)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            text=True,
            cwd=REPO_ROOT,
            env=env,
            start_new_session=True,
            preexec_fn=(lambda: os.sched_setaffinity(0, self.cpus)) if self.cpus else None,
        )
        threading.Thread(target=self._drain, daemon=True).start()
        started = time.monotonic()
        deadline = started + self.startup_timeout_s
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise ServiceError(f"service did not start within {self.startup_timeout_s} s:\n{self.log()}")
            try:
                line = self._lines_q.get(timeout=min(remaining, 1.0))
            except queue.Empty:
                continue
            if line is None:
                raise ServiceError(f"service exited during start-up:\n{self.log()}")
            if line.startswith(("runtime worker:", "runtime: starting the worker")):  # where a start-up spends its time
                print(f"[service {time.monotonic() - started:6.1f}s] {line.rstrip()}", file=sys.stderr, flush=True)
            match = _SERVING.search(line)
            if match:
                self.address = match.group(1)
                # What the start-up took, as the worker reported it (load, warm-up, limits).
                startup = [seen.strip() for seen in self.lines if seen.startswith(("runtime worker:", "runtime: limits"))]
                self.banner = "\n".join(startup + [line.strip()])
                return

    def _drain(self) -> None:
        assert self.proc is not None and self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            self._lines_q.put(line)
        self._lines_q.put(None)

    def log(self) -> str:
        """The last lines the service printed."""
        return "".join(self.lines)

    def stop(self) -> None:
        """SIGTERM the ``runtime up`` process (a clean shutdown), then SIGKILL its whole group."""
        proc, self.proc = self.proc, None
        if proc is not None:
            end_group(proc, term_group=False)

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid

    def worker_pid(self) -> int | None:
        """The worker: the (python) child process of the ``runtime up`` process."""
        children = child_pids(self.pid)
        return children[0] if children else None


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc on Linux, ``ps`` elsewhere), oldest first."""
    proc = Path("/proc")
    if proc.is_dir():
        out = []
        for entry in proc.iterdir():
            if not entry.name.isdigit():
                continue
            try:
                stat = (entry / "stat").read_text()
            except OSError:
                continue
            # Fields after the parenthesised command name: state, ppid, ...
            fields = stat.rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(entry.name))
        return sorted(out)
    res = subprocess.run(["ps", "-A", "-o", "pid=,ppid="], capture_output=True, text=True, check=False)
    kids = []
    for line in res.stdout.splitlines():
        parts = line.split()
        if len(parts) == 2 and int(parts[1]) == pid:
            kids.append(int(parts[0]))
    return sorted(kids)


def rss_bytes(pid: int) -> int | None:
    """Resident set size of ``pid``: VmRSS from /proc on Linux, ``ps -o rss=`` on macOS."""
    status = Path(f"/proc/{pid}/status")
    if status.exists():
        try:
            for line in status.read_text().splitlines():
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
        except OSError:
            return None
        return None
    res = subprocess.run(["ps", "-o", "rss=", "-p", str(pid)], capture_output=True, text=True, check=False)
    text = res.stdout.strip()
    return int(text) * 1024 if text.isdigit() else None


def gpu_memory_bytes() -> dict[int, int] | None:
    """Device memory per process from ``nvidia-smi`` (None where there is no nvidia-smi).

    On CUDA a process's RSS does not include what it holds on the GPU.
    """
    try:
        res = subprocess.run(
            ["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
            capture_output=True, text=True, timeout=10, check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    out: dict[int, int] = {}
    for line in res.stdout.splitlines():
        parts = [p.strip() for p in line.split(",")]
        if len(parts) == 2 and parts[0].isdigit() and parts[1].isdigit():
            out[int(parts[0])] = int(parts[1]) * 2**20
    return out
