"""CURVE on the client socket: keys, the bind guard, a pure-zmq handshake, and the real service."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import zmq
from conftest import REPO, running_config

from runtime.config import ConfigError, ServerConfig, parse_config
from runtime.protocol.security import (
    SecurityError,
    check_bind_allowed,
    client_keys,
    generate_keypair,
    public_key_of,
    secure_client,
    secure_server,
)


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


# --- keys -------------------------------------------------------------------------------------


def test_keypair_round_trip():
    public, secret = generate_keypair()
    assert len(public) == len(secret) == 40
    assert public != secret
    assert public_key_of(secret) == public
    assert generate_keypair() != (public, secret)


@pytest.mark.parametrize("bad", ["", "short", "~" * 40, "#" * 40, "é" * 40])
def test_bad_server_secret_key_names_the_config_key(bad):
    server = ServerConfig(curve_secret_key=bad)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        if bad == "":  # empty means CURVE off: nothing to complain about
            assert secure_server(ctx, sock, server) is None
            return
        with pytest.raises(SecurityError, match=r"server\.curve_secret_key"):
            secure_server(ctx, sock, server)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_bad_client_key_names_its_index():
    _, secret = generate_keypair()
    good, _ = generate_keypair()
    server = ServerConfig(curve_secret_key=secret, curve_client_keys=(good, "nope"))
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    try:
        with pytest.raises(SecurityError, match=r"server\.curve_client_keys\[1\]"):
            secure_server(ctx, sock, server)
    finally:
        sock.close(linger=0)
        ctx.term()


def test_config_validation_names_the_key():
    _, secret = generate_keypair()
    with pytest.raises(ConfigError, match=r"'server\.curve_secret_key'"):
        parse_config({"model": {"path": "/x"}, "server": {"curve_secret_key": "x" * 39}})
    with pytest.raises(ConfigError, match=r"'server\.curve_client_keys\[0\]'"):
        parse_config({"model": {"path": "/x"}, "server": {"curve_secret_key": secret, "curve_client_keys": ["?"]}})
    with pytest.raises(ConfigError, match=r"needs 'server\.curve_secret_key'"):
        parse_config({"model": {"path": "/x"}, "server": {"curve_client_keys": [generate_keypair()[0]]}})
    config = parse_config({"model": {"path": "/x"}, "server": {"curve_secret_key": secret}})
    assert config.server.curve_secret_key == secret


def test_client_keys_rules():
    server_pub, _ = generate_keypair()
    public, secret = generate_keypair()
    assert client_keys(None, None, None) is None
    ephemeral = client_keys(server_pub, None, None)
    assert ephemeral is not None and ephemeral[0] == server_pub.encode()
    assert client_keys(server_pub, public, secret) == (server_pub.encode(), public.encode(), secret.encode())
    with pytest.raises(SecurityError, match="both"):
        client_keys(server_pub, public, None)
    with pytest.raises(SecurityError, match="does not belong"):
        client_keys(server_pub, generate_keypair()[0], secret)
    with pytest.raises(SecurityError, match="server's public key"):
        client_keys(None, public, secret)
    with pytest.raises(SecurityError, match="server key"):
        client_keys("bad", None, None)


# --- the bind guard -----------------------------------------------------------------------------


@pytest.mark.parametrize(
    "address, allowed",
    [
        ("tcp://127.0.0.1:5555", True),
        ("tcp://127.3.4.5:5555", True),
        ("tcp://localhost:5555", True),
        ("tcp://[::1]:5555", True),
        ("ipc:///tmp/x.sock", True),
        ("tcp://0.0.0.0:5555", False),
        ("tcp://*:5555", False),
        ("tcp://192.168.1.20:5555", False),
        ("tcp://[::]:5555", False),
        ("tcp://eth0:5555", False),
    ],
)
def test_check_bind_allowed_without_curve(address, allowed):
    if allowed:
        check_bind_allowed(address, ServerConfig())
        return
    with pytest.raises(SecurityError) as raised:
        check_bind_allowed(address, ServerConfig())
    message = str(raised.value)
    assert address in message
    assert "server.curve_secret_key" in message and "runtime keygen" in message
    assert "server.allow_insecure = true" in message


@pytest.mark.parametrize("address", ["tcp://0.0.0.0:5555", "tcp://*:5555", "tcp://192.168.1.20:5555"])
def test_check_bind_allowed_with_key_or_allow_insecure(address):
    check_bind_allowed(address, ServerConfig(allow_insecure=True))
    check_bind_allowed(address, ServerConfig(curve_secret_key=generate_keypair()[1]))


# --- a pure-zmq handshake -----------------------------------------------------------------------


class _Echo:
    """A CURVE ROUTER on loopback that answers each message it receives with ``b"pong"``."""

    def __init__(self, ctx: zmq.Context, server: ServerConfig) -> None:
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.auth = secure_server(ctx, self.sock, server)
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")

    def answer_one(self, timeout_ms: int) -> bool:
        """Receive one message within ``timeout_ms`` and reply; False when none came."""
        if not self.sock.poll(timeout_ms):
            return False
        identity, payload = self.sock.recv_multipart()
        assert payload == b"ping"
        self.sock.send_multipart([identity, b"pong"])
        return True


@contextmanager
def _echo_server(server: ServerConfig) -> Iterator[tuple[zmq.Context, _Echo]]:
    ctx = zmq.Context()
    echo = _Echo(ctx, server)
    try:
        yield ctx, echo
    finally:
        echo.sock.close(linger=0)
        if echo.auth is not None:
            echo.auth.stop()
        ctx.term()


def _ask(ctx: zmq.Context, echo: _Echo, server_key: str | None, public: str | None, secret: str | None, wait_ms: int):
    """Send ``ping`` from a fresh DEALER; the reply, or None when nothing arrives in time."""
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    try:
        secure_client(dealer, server_key, public, secret)
        dealer.connect(f"tcp://127.0.0.1:{echo.port}")
        dealer.send(b"ping")
        if not echo.answer_one(wait_ms):
            return None
        return dealer.recv() if dealer.poll(wait_ms) else None
    finally:
        dealer.close(linger=0)


def test_allowed_client_gets_a_reply_others_get_nothing():
    server_pub, server_sec = generate_keypair()
    allowed_pub, allowed_sec = generate_keypair()
    stranger_pub, stranger_sec = generate_keypair()
    config = ServerConfig(curve_secret_key=server_sec, curve_client_keys=(allowed_pub,))
    with _echo_server(config) as (ctx, echo):
        assert echo.auth is not None
        assert _ask(ctx, echo, server_pub, allowed_pub, allowed_sec, 5000) == b"pong"
        assert _ask(ctx, echo, server_pub, stranger_pub, stranger_sec, 1000) is None
        assert _ask(ctx, echo, server_pub, None, None, 1000) is None  # an ephemeral key is a stranger too
        assert _ask(ctx, echo, None, None, None, 1000) is None  # plain, no CURVE
        assert _ask(ctx, echo, stranger_pub, allowed_pub, allowed_sec, 1000) is None  # wrong server key
        # The refusals left the socket serving.
        assert _ask(ctx, echo, server_pub, allowed_pub, allowed_sec, 5000) == b"pong"


def test_empty_client_list_allows_any_key_holder():
    server_pub, server_sec = generate_keypair()
    with _echo_server(ServerConfig(curve_secret_key=server_sec)) as (ctx, echo):
        assert _ask(ctx, echo, server_pub, None, None, 5000) == b"pong"
        assert _ask(ctx, echo, server_pub, *generate_keypair(), 5000) == b"pong"
        assert _ask(ctx, echo, None, None, None, 1000) is None


def test_no_key_means_a_plain_socket():
    with _echo_server(ServerConfig()) as (ctx, echo):
        assert echo.auth is None
        assert _ask(ctx, echo, None, None, None, 5000) == b"pong"


# --- the real service ---------------------------------------------------------------------------


def _curve_config(tmp_path, model, secret: str, client_keys_toml: str = "") -> tuple[str, object]:
    port = _free_port()
    config = tmp_path / "curve.toml"
    config.write_text(
        f'[model]\npath = "{model}"\n[server]\naddress = "tcp://127.0.0.1:{port}"\n'
        f'curve_secret_key = "{secret}"\n{client_keys_toml}'
    )
    return f"tcp://127.0.0.1:{port}", config


def _runtime(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "runtime.cli", *args],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=REPO,
        env={**os.environ, **(env or {})},
    )


def test_service_with_curve_answers_only_key_holders(model_dir, tmp_path):
    from runtime.client import ServiceUnavailable, SyncClient

    server_pub, server_sec = generate_keypair()
    address, config = _curve_config(tmp_path, model_dir("llama"), server_sec)
    with running_config(config) as svc:
        assert svc.address == address
        with SyncClient(svc.address, timeout_s=10, server_key=server_pub) as client:
            assert client.status(timeout=10).model_type == "llama"
        with SyncClient(svc.address, timeout_s=10) as plain:
            with pytest.raises(ServiceUnavailable):
                plain.status(timeout=1.0)
        with SyncClient(svc.address, timeout_s=10, server_key=generate_keypair()[0]) as wrong:
            with pytest.raises(ServiceUnavailable):
                wrong.status(timeout=1.0)
        by_flag = _runtime("status", "-a", svc.address, f"--server-key={server_pub}")  # Z85 may begin with "-"
        by_env = _runtime("status", "-a", svc.address, env={"RUNTIME_SERVER_KEY": server_pub})
        without = _runtime("status", "-a", svc.address, "--timeout", "1")
        # Still serving after the refused clients.
        with SyncClient(svc.address, timeout_s=10, server_key=server_pub) as client:
            assert client.generate("hi", max_tokens=2, ignore_eos=True).finish_reason == "length"
    assert by_flag.returncode == 0 and "model_type: llama" in by_flag.stdout, by_flag.stderr
    assert by_env.returncode == 0 and "model_type: llama" in by_env.stdout, by_env.stderr
    assert without.returncode != 0 and "no reply" in without.stderr


def test_service_with_client_list_refuses_other_keys(model_dir, tmp_path):
    from runtime.client import ServiceUnavailable, SyncClient

    server_pub, server_sec = generate_keypair()
    client_pub, client_sec = generate_keypair()
    _, config = _curve_config(tmp_path, model_dir("llama"), server_sec, f'curve_client_keys = ["{client_pub}"]\n')
    with running_config(config) as svc:
        with SyncClient(svc.address, timeout_s=10, server_key=server_pub) as stranger:
            with pytest.raises(ServiceUnavailable):
                stranger.status(timeout=1.0)
        keys = dict(server_key=server_pub, public_key=client_pub, secret_key=client_sec)
        with SyncClient(svc.address, timeout_s=10, **keys) as client:
            assert client.status(timeout=10).model_type == "llama"
        env = {"RUNTIME_SERVER_KEY": server_pub, "RUNTIME_PUBLIC_KEY": client_pub, "RUNTIME_SECRET_KEY": client_sec}
        generated = _runtime("generate", "-a", svc.address, "--max-tokens", "2", "--ignore-eos", "hi", env=env)
    assert generated.returncode == 0, generated.stderr


def test_cli_rejects_a_bad_key_before_connecting(tmp_path):
    done = _runtime("status", "-a", f"ipc://{tmp_path}/none.sock", "--server-key", "not-a-key")
    assert done.returncode == 2
    assert "server key" in done.stderr
    assert "Z85" in done.stderr and "Traceback" not in done.stderr


def test_a_key_that_begins_with_a_dash_passes_in_the_equals_form(tmp_path):
    key = "-" + "a" * 39  # Z85 has "-" in its alphabet: a fifth of a percent of keys begin with it
    done = _runtime("status", "-a", f"ipc://{tmp_path}/none.sock", "--timeout", "1", f"--server-key={key}")
    assert "expected one argument" not in done.stderr  # parsed as the flag's value, not as another flag
    assert "Traceback" not in done.stderr
