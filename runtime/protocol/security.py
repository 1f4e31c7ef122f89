"""ZeroMQ CURVE for the client socket: key pairs, server and client set-up, the bind guard.

Keys are Z85 strings (40 characters, 32 bytes). With ``server.curve_secret_key`` set the
client ROUTER becomes a CURVE server and a ZAP authenticator admits only the public keys in
``server.curve_client_keys`` (any client when that list is empty). A client that lacks the
server's public key, or whose key is not allowed, never completes the handshake: it sees no
reply at all, which the client library reports as "no reply" (``ServiceUnavailable``).
"""

from __future__ import annotations

import struct
from typing import TYPE_CHECKING

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from runtime.config.sections import is_loopback

if TYPE_CHECKING:
    from runtime.config.sections import ServerConfig

KEY_CHARS = 40  # Z85 of 32 bytes


class SecurityError(ValueError):
    """A key or address setting a person must fix; the message names the setting."""


def generate_keypair() -> tuple[str, str]:
    """A new CURVE key pair as Z85 strings: ``(public, secret)``."""
    public, secret = zmq.curve_keypair()
    return public.decode("ascii"), secret.decode("ascii")


def check_key(key: str, name: str) -> bytes:
    """The Z85 ``key`` as bytes for zmq; raises SecurityError naming ``name`` when it is not one."""
    if not isinstance(key, str) or len(key) != KEY_CHARS:
        got = f"{len(key)} characters" if isinstance(key, str) else type(key).__name__
        raise SecurityError(f"{name} must be a {KEY_CHARS}-character Z85 key (from `runtime keygen`), got {got}")
    try:
        raw = z85.decode(key)
    except (ValueError, KeyError, TypeError, struct.error):
        raise SecurityError(f"{name} is not a valid Z85 key (make one with `runtime keygen`)") from None
    if len(raw) != 32:
        raise SecurityError(f"{name} is not a valid Z85 key (make one with `runtime keygen`)")
    return key.encode("ascii")


def public_key_of(secret: str) -> str:
    """The Z85 public key belonging to the Z85 secret key ``secret``."""
    return zmq.curve_public(check_key(secret, "secret key")).decode("ascii")


class _AllowedKeys:
    """ZAP credentials provider: a client is let in when its Z85 public key is in the set."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def secure_server(ctx: zmq.Context, sock: zmq.Socket, server: ServerConfig) -> ThreadAuthenticator | None:
    """Make ``sock`` a CURVE server when ``server.curve_secret_key`` is set; call before bind.

    Returns the running ZAP authenticator (stop it with ``.stop()`` at shutdown), or None when
    CURVE is off. The authenticator must live on ``ctx``, the context that owns ``sock``.
    """
    if not server.curve_secret_key:
        if server.curve_client_keys:
            raise SecurityError("server.curve_client_keys is set but server.curve_secret_key is empty")
        return None
    secret = check_key(server.curve_secret_key, "server.curve_secret_key")
    allowed = frozenset(
        check_key(key, f"server.curve_client_keys[{i}]") for i, key in enumerate(server.curve_client_keys)
    )
    auth = ThreadAuthenticator(ctx)
    auth.start()
    if allowed:
        auth.configure_curve_callback(domain="*", credentials_provider=_AllowedKeys(allowed))
    else:
        auth.configure_curve(domain="*", location=zmq.auth.CURVE_ALLOW_ANY)
    sock.curve_secretkey = secret
    sock.curve_publickey = zmq.curve_public(secret)
    sock.curve_server = True
    return auth


def client_keys(
    server_key: str | None, public_key: str | None, secret_key: str | None
) -> tuple[bytes, bytes, bytes] | None:
    """Checked CURVE client keys as ``(server, public, secret)`` bytes, or None for a plain connection.

    Neither client key given: an ephemeral pair (enough for a server that allows any client).
    """
    if not server_key:
        if public_key or secret_key:
            raise SecurityError("a client key pair was given without the server's public key (--server-key)")
        return None
    server = check_key(server_key, "server key")
    if not public_key and not secret_key:
        public_key, secret_key = generate_keypair()
    elif not public_key or not secret_key:
        raise SecurityError("give both the client's public key and its secret key, or neither")
    public = check_key(public_key, "client public key")
    secret = check_key(secret_key, "client secret key")
    if zmq.curve_public(secret) != public:
        raise SecurityError("the client public key does not belong to the client secret key")
    return server, public, secret


def secure_client(sock: zmq.Socket, server_key: str | None, public_key: str | None, secret_key: str | None) -> None:
    """Make ``sock`` a CURVE client of the server with public key ``server_key``; call before connect.

    No ``server_key``: nothing changes (a plain connection). See ``client_keys`` for the rest.
    """
    keys = client_keys(server_key, public_key, secret_key)
    if keys is None:
        return
    server, public, secret = keys
    sock.curve_serverkey = server
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def _tcp_host(address: str) -> str | None:
    """The host part of ``tcp://HOST:PORT`` (brackets of IPv6 removed), or None for other transports."""
    if not address.startswith("tcp://"):
        return None
    rest = address[len("tcp://") :]
    host = rest.rsplit(":", 1)[0] if ":" in rest else rest
    if ";" in host:  # tcp://SOURCE;HOST:PORT names a source interface first
        host = host.rsplit(";", 1)[1]
    return host[1:-1] if host.startswith("[") and host.endswith("]") else host


def check_bind_allowed(client_address: str, server: ServerConfig) -> None:
    """Refuse a TCP bind beyond loopback without CURVE, unless ``server.allow_insecure`` is set."""
    host = _tcp_host(client_address)
    if host is None or is_loopback(host) or server.curve_secret_key or server.allow_insecure:
        return
    raise SecurityError(
        f"refusing to serve {client_address} without encryption: anyone on the network could use it; "
        "set server.curve_secret_key (make a key pair with `runtime keygen`), "
        "or set server.allow_insecure = true to accept that"
    )


__all__ = [
    "SecurityError",
    "generate_keypair",
    "public_key_of",
    "check_key",
    "secure_server",
    "client_keys",
    "secure_client",
    "check_bind_allowed",
]
