"""Shared fixtures: tiny model folders and a real `runtime up` service per test."""

from __future__ import annotations

import os
import queue
import re
import signal
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import pytest

# The test models are float32. On a CUDA GPU, MLX's float32 matrix products of many rows use TF32
# by default (10-bit mantissas), while mlx-lm's one-row reference runs full float32 products: a
# batch of 4 parted from it with logprob gaps of 0.14-0.16 nats on an H100 (session 28). Tests
# check our batching, not MLX's precision mode, so every process they start computes in float32.
# It must be set before MLX's first product (MLX reads it once); the CPU ignores it.
os.environ["MLX_ENABLE_TF32"] = "0"

sys.path.insert(0, str(Path(__file__).parent))

from model_factory import make_model  # noqa: E402

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory):
    """Build (once per session) a tiny model folder for an architecture."""
    built: dict[str, Path] = {}

    def get(arch: str) -> Path:
        if arch not in built:
            built[arch] = make_model(arch, tmp_path_factory.mktemp(arch))
        return built[arch]

    return get


@dataclass
class Service:
    """A running `runtime up` process group."""

    proc: subprocess.Popen
    address: str
    lines: list[str] = field(default_factory=list)

    def log(self) -> str:
        return "".join(self.lines)


def _reader(proc: subprocess.Popen, out: queue.Queue, lines: list[str]) -> None:
    assert proc.stdout is not None
    for line in proc.stdout:
        lines.append(line)
        out.put(line)
    out.put(None)


def start_runtime(config_file: Path, env: dict | None = None) -> tuple[subprocess.Popen, queue.Queue, list[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", "-c", str(config_file)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
        start_new_session=True,
        env={**os.environ, **(env or {})},
    )
    lines: list[str] = []
    out: queue.Queue = queue.Queue()
    threading.Thread(target=_reader, args=(proc, out, lines), daemon=True).start()
    return proc, out, lines


def kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait(timeout=10)


def worker_pid(proc: subprocess.Popen, timeout: float = 60.0) -> int:
    """The pid of `runtime up`'s worker as soon as it is launched (found among its children by
    command line), so a test can freeze it in its start-up."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "runtime up exited during start-up"
        try:
            children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        except OSError:
            children = []
        for pid in children:
            try:
                if b"runtime.worker" in Path(f"/proc/{pid}/cmdline").read_bytes():
                    return int(pid)
            except OSError:
                continue
        time.sleep(0.002)  # polling the process table, bounded by the deadline
    raise AssertionError("no worker process appeared")


@contextmanager
def running_config(config_file: Path, timeout: float = 90.0):
    """Start `runtime up -c config_file`; always tear the whole process group down."""
    proc, out, lines = start_runtime(config_file)
    try:
        deadline = time.monotonic() + timeout
        address = None
        while address is None:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError("service did not start:\n" + "".join(lines))
            try:
                line = out.get(timeout=remaining)
            except queue.Empty:
                continue
            if line is None:
                raise RuntimeError("service exited during start-up:\n" + "".join(lines))
            match = re.search(r"on ((?:ipc|tcp)://\S+)", line)
            if "serving" in line and match:
                address = match.group(1)
        yield Service(proc=proc, address=address, lines=lines)
    finally:
        stop_runtime(proc)


def stop_runtime(proc: subprocess.Popen, timeout: float = 10.0) -> None:
    """SIGTERM `runtime up` (its clean shutdown), then kill whatever of its group is left."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            pass
    kill_group(proc)


@contextmanager
def running_service(tmp_path: Path, model: Path, extra: str = "", timeout: float = 90.0):
    """Start `runtime up` on an ipc socket in a temp dir; always tear the whole group down."""
    config_file = tmp_path / "service.toml"
    config_file.write_text(f'[model]\npath = "{model}"\n[server]\naddress = "ipc://"\n{extra}\n')
    with running_config(config_file, timeout) as svc:
        yield svc


@pytest.fixture
def service_factory(tmp_path):
    """`with service_factory(model_folder, extra_toml) as svc:` starts a real service."""

    def factory(model: Path, extra: str = ""):
        return running_service(tmp_path, model, extra)

    return factory
