"""`runtime up` refuses a bad start in seconds, before the model loads, with one clear line."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import stat
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, kill_group, running_config

from runtime.config import parse_config
from runtime.protocol.security import public_key_of

QUICK_S = 20.0  # far less than a model load plus a worker start would take with a broken folder


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _up(config: Path, timeout: float = QUICK_S) -> tuple[int, str, str, float]:
    """Run `runtime up -c config` to its end in its own process group: (rc, stdout, stderr, seconds)."""
    start = time.monotonic()
    proc = subprocess.Popen(
        [sys.executable, "-m", "runtime.cli", "up", "-c", str(config)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=REPO,
        start_new_session=True,
    )
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, err = proc.communicate()
        pytest.fail(f"`runtime up` still running after {timeout} s:\n{out}\n{err}")
    finally:
        kill_group(proc)
    return proc.returncode, out, err, time.monotonic() - start


@pytest.fixture
def short_dir() -> Iterator[Path]:
    """A short directory under /tmp: unix socket paths must stay under ~100 characters."""
    path = Path(tempfile.mkdtemp(prefix="rt-", dir="/tmp"))
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


@pytest.fixture
def unloadable_model(model_dir, tmp_path) -> Path:
    """A folder with a tokenizer but no weights: loading it fails, so only an early check passes."""
    folder = tmp_path / "no-weights"
    folder.mkdir()
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        (folder / name).write_bytes((model_dir("llama") / name).read_bytes())
    return folder


def _config(tmp_path: Path, model: Path, address: str, extra: str = "") -> Path:
    config = tmp_path / "c.toml"
    config.write_text(f'[model]\npath = "{model}"\n[server]\naddress = "{address}"\n{extra}')
    return config


def _status_ok(address: str) -> bool:
    from runtime.client import SyncClient

    with SyncClient(address, timeout_s=10) as client:
        return client.status(timeout=10).model_type == "llama"


def test_port_in_use_is_refused_before_the_model_loads(unloadable_model, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        rc, _, err, seconds = _up(_config(tmp_path, unloadable_model, f"tcp://127.0.0.1:{port}"))
    assert rc != 0
    assert f"address tcp://127.0.0.1:{port} is already in use" in err
    assert "Traceback" not in err
    assert "No safetensors" not in err  # the worker never tried to load the model
    assert seconds < QUICK_S


def test_second_service_on_a_live_ipc_path_is_refused(model_dir, tmp_path, short_dir):
    path = short_dir / "svc.sock"
    config = _config(tmp_path, model_dir("llama"), f"ipc://{path}")
    with running_config(config) as svc:
        assert svc.address == f"ipc://{path}"
        rc, _, err, seconds = _up(config)
        assert rc != 0
        assert f"another service is answering on ipc://{path}" in err
        assert "Traceback" not in err and seconds < QUICK_S
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        assert _status_ok(svc.address)  # the first one keeps its address


def test_stale_socket_file_is_taken_over(model_dir, tmp_path, short_dir):
    path = short_dir / "svc.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(path))
    dead.close()  # the file stays behind, as after a crash
    assert stat.S_ISSOCK(os.lstat(path).st_mode)
    with running_config(_config(tmp_path, model_dir("llama"), f"ipc://{path}")) as svc:
        assert _status_ok(svc.address)


def test_socket_file_is_removed_after_sigterm(model_dir, tmp_path, short_dir):
    path = short_dir / "svc.sock"
    with running_config(_config(tmp_path, model_dir("llama"), f"ipc://{path}")) as svc:
        assert stat.S_ISSOCK(os.lstat(path).st_mode)
        svc.proc.send_signal(signal.SIGTERM)
        assert svc.proc.wait(timeout=10) == 0
        assert not os.path.lexists(path)


def test_a_file_that_is_not_a_socket_is_left_alone(unloadable_model, tmp_path, short_dir):
    path = short_dir / "notes.txt"
    path.write_text("keep me")
    rc, _, err, _ = _up(_config(tmp_path, unloadable_model, f"ipc://{path}"))
    assert rc != 0 and "is not a socket" in err and "Traceback" not in err
    assert path.read_text() == "keep me"


def test_missing_model_folder_says_so(tmp_path):
    missing = tmp_path / "no-such-model"
    config = _config(tmp_path, missing, "ipc://")
    rc, _, err, seconds = _up(config)
    assert rc == 1
    assert f"runtime: no such folder: {missing} (model.path in {config})" in err
    assert "Traceback" not in err and "repo" not in err.lower()
    assert seconds < QUICK_S


def _session_members(sid: int) -> list[int]:
    """Live processes of session ``sid`` (``runtime up`` runs in a session of its own)."""
    members = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":  # fields: state, ppid, pgrp, session
                members.append(int(entry.name))
    return members


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads sessions from /proc")
def test_a_broken_tokenizer_fails_the_start_and_stops_the_launched_worker(model_dir, tmp_path, short_dir):
    # The worker is launched before the tokenizer loads (their start-ups overlap); a tokenizer
    # that cannot load must still end the service with one line and leave no worker behind.
    folder = tmp_path / "broken-tokenizer"
    shutil.copytree(model_dir("llama"), folder)
    (folder / "tokenizer.json").write_text("{ not json")
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "up", "-c",
                             str(_config(tmp_path, folder, f"ipc://{short_dir}/s.sock"))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        _, err = proc.communicate(timeout=60)
        left = _session_members(proc.pid)
    finally:
        kill_group(proc)
    assert proc.returncode == 1
    assert "runtime: cannot load the tokenizer from" in err and "Traceback" not in err
    assert left == [], f"processes left behind by the failed start: {left}"


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="reads sessions from /proc")
def test_ctrl_c_during_a_worker_start_that_never_ends_stops_at_once(model_dir, tmp_path, short_dir):
    # Weights behind a FIFO nobody writes: the worker's load blocks forever, like a long GPU
    # warm-up. Ctrl-C (SIGINT to the whole group) must still end the service in seconds.
    folder = tmp_path / "blocking-weights"
    shutil.copytree(model_dir("llama"), folder)
    for weights in folder.glob("*.safetensors"):
        weights.unlink()
        os.mkfifo(weights)
    proc = subprocess.Popen([sys.executable, "-m", "runtime.cli", "up", "-c",
                             str(_config(tmp_path, folder, f"ipc://{short_dir}/s.sock"))],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                            start_new_session=True)
    try:
        assert proc.stdout is not None
        first = proc.stdout.readline()  # printed once Ctrl-C is handled, before the worker is waited for
        assert first.startswith("runtime: starting the worker for"), first
        os.killpg(proc.pid, signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
        left = _session_members(proc.pid)
    finally:
        kill_group(proc)
    assert proc.returncode == 0, out
    assert "runtime: stopped during start-up" in out and "Traceback" not in out, out
    assert left == [], f"processes left behind: {left}"


@pytest.mark.parametrize("host", ["0.0.0.0", "*"])
def test_non_loopback_without_curve_is_refused(unloadable_model, tmp_path, host):
    address = f"tcp://{host}:{_free_port()}"
    rc, _, err, seconds = _up(_config(tmp_path, unloadable_model, address))
    assert rc != 0
    assert address in err and "allow_insecure" in err and "runtime keygen" in err
    assert "Traceback" not in err and "No safetensors" not in err
    assert seconds < QUICK_S


def test_keygen_json_gives_a_working_pair():
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "keygen", "--json"], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    keys = json.loads(done.stdout)
    assert set(keys) == {"public", "secret"}
    assert public_key_of(keys["secret"]) == keys["public"]


def test_keygen_text_gives_toml_to_paste():
    done = subprocess.run(
        [sys.executable, "-m", "runtime.cli", "keygen"], capture_output=True, text=True, timeout=30, cwd=REPO
    )
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    public = next(line.removeprefix("public: ") for line in lines if line.startswith("public: "))
    secret = next(line.removeprefix("secret: ") for line in lines if line.startswith("secret: "))
    assert public_key_of(secret) == public
    toml = "\n".join(line for line in lines if not line.startswith(("public:", "secret:", "#")))
    config = parse_config({"model": {"path": "/x"}, **tomllib.loads(toml)})
    assert config.server.curve_secret_key == secret
