"""Client and worker socket addresses, and binding the client socket with clear start-up errors.

``bind_client`` runs before the model loads, so a taken address fails in a second, not after
the load. An explicit ``ipc:///path`` needs care: libzmq unlinks an existing socket file on
bind, which would silently steal the address from a live service. So an existing file is
probed first: a service that accepts a connection keeps it; a dead one's file is removed.
"""

from __future__ import annotations

import errno
import os
import shutil
import socket
import stat
import tempfile
from dataclasses import dataclass
from typing import TYPE_CHECKING

import zmq

if TYPE_CHECKING:
    from runtime.config import ServerConfig

PROBE_TIMEOUT_S = 0.5


class AddressError(RuntimeError):
    """The client address cannot be bound; the message is one line a person can act on."""


@dataclass
class Addresses:
    """Where clients connect, where the worker connects, and the private dir to clean up.

    ``bound_ipc`` is the (device, inode) of an explicit ipc socket file this process bound,
    so ``cleanup`` removes that file and never a newer one another service made.
    """

    client: str
    worker: str
    private_dir: str
    bound_ipc: tuple[int, int] | None = None

    @property
    def explicit_ipc_path(self) -> str | None:
        """The socket file of an ``ipc:///path`` client address outside the private dir, else None."""
        if not self.client.startswith("ipc://"):
            return None
        path = self.client[len("ipc://") :]
        if path in ("", "*") or os.path.dirname(os.path.abspath(path)) == os.path.abspath(self.private_dir):
            return None
        return path

    def cleanup(self) -> None:
        """Remove the private dir and the explicit ipc socket file this process bound."""
        path = self.explicit_ipc_path
        if path is not None and self.bound_ipc is not None:
            try:
                st = os.stat(path)
                if (st.st_dev, st.st_ino) == self.bound_ipc:
                    os.unlink(path)
            except FileNotFoundError:
                pass  # libzmq removes it itself when the socket closes cleanly
        self.bound_ipc = None
        shutil.rmtree(self.private_dir, ignore_errors=True)


def resolve(address: str, host: str) -> Addresses:
    """``ipc://`` gets a socket file in a fresh private directory; ``tcp://:PORT`` binds ``host``."""
    private_dir = tempfile.mkdtemp(prefix="runtime-")
    os.chmod(private_dir, 0o700)
    if address in ("ipc://", "ipc"):
        client = f"ipc://{private_dir}/client.sock"
    elif address.startswith("tcp://:"):
        client = f"tcp://{host}:{address[len('tcp://:'):]}"
    else:
        client = address
    return Addresses(client=client, worker=f"ipc://{private_dir}/worker.sock", private_dir=private_dir)


def _service_answers(path: str) -> bool:
    """Whether something accepts a connection on the unix socket file ``path``."""
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(PROBE_TIMEOUT_S)
    try:
        probe.connect(path)
    except TimeoutError:
        return True  # a full accept queue: alive, only busy
    except OSError:
        return False  # refused: nobody listens on this file any more
    finally:
        probe.close()
    return True


def _clear_ipc_path(address: str, path: str) -> None:
    """Refuse a live service's socket file; remove a stale one."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(mode):
        raise AddressError(f"{path} exists and is not a socket; choose another server.address")
    if _service_answers(path):
        raise AddressError(f"another service is answering on {address}; stop it or choose another server.address")
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def bind_client(sock: zmq.Socket, addresses: Addresses) -> None:
    """Bind the client socket at ``addresses.client``; failures raise AddressError."""
    address = addresses.client
    path = addresses.explicit_ipc_path
    if path is not None:
        _clear_ipc_path(address, path)
    try:
        sock.bind(address)
    except zmq.ZMQError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise AddressError(f"address {address} is already in use") from None
        raise AddressError(f"cannot bind {address}: {exc.strerror}") from None
    if path is not None:
        st = os.stat(path)
        addresses.bound_ipc = (st.st_dev, st.st_ino)


HEARTBEAT_IVL_MS = 2000
HEARTBEAT_TIMEOUT_MS = 10000


def open_client_socket(ctx: zmq.Context, addresses: Addresses, server: ServerConfig) -> tuple[zmq.Socket, object | None]:
    """The clients' ROUTER socket, secured and bound, and its CURVE authenticator (or None).

    Full or departed peers raise on send instead of dropping (ROUTER_MANDATORY); a message over
    ``server.max_message_mb`` closes its connection; ZMTP heartbeats drop vanished TCP hosts.
    """
    from runtime.protocol.security import check_bind_allowed, secure_server

    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    sock.setsockopt(zmq.MAXMSGSIZE, int(server.max_message_mb * 2**20))
    sock.setsockopt(zmq.HEARTBEAT_IVL, HEARTBEAT_IVL_MS)
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, HEARTBEAT_TIMEOUT_MS)
    auth = None
    try:
        check_bind_allowed(addresses.client, server)
        auth = secure_server(ctx, sock, server)
        bind_client(sock, addresses)
    except BaseException:
        if auth is not None:
            auth.stop()
        sock.close(0)
        raise
    return sock, auth
