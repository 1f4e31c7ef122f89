"""The hosts of a tensor-parallel worker, read from a hostfile in ``mlx.launch``'s format.

The format is mlx.launch's JSON: either a list of hosts or ``{"backend": ..., "envs": [...],
"hosts": [...]}``, each host ``{"ssh": NAME, "ips": [IP, ...], "rdma": [...]}``. Rank i runs on
host i. Pure Python (no mlx, no zmq): the config check reads it before anything starts.
"""

from __future__ import annotations

import ipaddress
import json
import socket
from dataclasses import dataclass
from pathlib import Path


class HostfileError(ValueError):
    """A hostfile a person must fix; the message names the file and the entry."""


@dataclass(frozen=True)
class Host:
    """One rank's machine: how to reach it by ssh, and the IPs its ring connections use."""

    ssh: str
    ips: tuple[str, ...]
    rdma: tuple[str | None, ...] = ()

    @property
    def local(self) -> bool:
        """True when the rank runs on this machine (started directly, not through ssh)."""
        return is_local_name(self.ssh)


@dataclass(frozen=True)
class Hostfile:
    """The hosts in rank order, plus the backend and environment the file asks for."""

    hosts: tuple[Host, ...]
    backend: str = ""
    envs: tuple[str, ...] = ()


def is_local_name(name: str) -> bool:
    """``localhost``, a loopback IP, or this machine's own host name."""
    if name in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


def read_hostfile(path: str | Path) -> Hostfile:
    """Parse ``path``; HostfileError with the reason when it is missing or malformed."""
    path = Path(path).expanduser()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise HostfileError(f"hostfile not found: {path}") from None
    except ValueError as exc:
        raise HostfileError(f"hostfile {path} is not valid JSON: {exc}") from None
    backend, envs, hosts = "", [], data
    if isinstance(data, dict):
        backend, envs, hosts = data.get("backend", ""), data.get("envs", []), data.get("hosts")
    if not isinstance(hosts, list) or not hosts:
        raise HostfileError(f"hostfile {path} must list hosts (a list, or an object with 'hosts')")
    if not isinstance(envs, list) or not all(isinstance(e, str) and "=" in e for e in envs):
        raise HostfileError(f"hostfile {path}: 'envs' must be a list of NAME=VALUE strings")
    parsed = []
    for i, h in enumerate(hosts):
        if not isinstance(h, dict) or not isinstance(h.get("ssh"), str) or not h["ssh"]:
            raise HostfileError(f"hostfile {path}: host {i} needs an 'ssh' name")
        ips = h.get("ips", [])
        if not isinstance(ips, list) or not all(isinstance(ip, str) for ip in ips):
            raise HostfileError(f"hostfile {path}: host {i} 'ips' must be a list of strings")
        for ip in ips:
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                raise HostfileError(f"hostfile {path}: host {i} has {ip!r} in 'ips', not an IP address") from None
        parsed.append(Host(h["ssh"], tuple(ips), tuple(h.get("rdma", []) or ())))
    return Hostfile(tuple(parsed), str(backend), tuple(envs))
