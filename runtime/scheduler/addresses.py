"""Client and worker socket addresses."""

from __future__ import annotations

import os
import shutil
import tempfile
from dataclasses import dataclass


@dataclass
class Addresses:
    """Where clients connect, where the worker connects, and the private dir to clean up."""

    client: str
    worker: str
    private_dir: str

    def cleanup(self) -> None:
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
