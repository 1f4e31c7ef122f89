"""CPU time of a service's processes, by role, over one round of a workload.

A host-bound service is limited by whichever of its processes saturates a core first; the
bench reads each process's user + system time from ``/proc/PID/stat`` before and after a
round, and reports it per role (scheduler: the ``runtime up`` process; worker; gateway, summed
over its processes) as a share of one core over the round's wall time. Linux only: elsewhere
the snapshot is empty and the report says so.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass, field
from pathlib import Path

_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def role_of(cmdline: str) -> str:
    """The service role of a process from its command line."""
    if "runtime.worker" in cmdline:
        return "worker"
    if "runtime.gateway" in cmdline:
        return "gateway"
    return "other"


def _stat(pid: int) -> tuple[int, float] | None:
    """(parent pid, CPU seconds) of ``pid``, or None when it is gone."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = text.rsplit(")", 1)[1].split()  # after the command name: state, ppid, ...
    return int(fields[1]), (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return ""


def tree_cpu(root_pid: int, root_role: str = "scheduler") -> dict[str, float]:
    """CPU seconds so far of ``root_pid`` (``root_role``) and its descendants, summed by role."""
    proc = Path("/proc")
    if not proc.is_dir():
        return {}
    stats: dict[int, tuple[int, float]] = {}
    for entry in proc.iterdir():
        if entry.name.isdigit():
            seen = _stat(int(entry.name))
            if seen is not None:
                stats[int(entry.name)] = seen
    if root_pid not in stats:
        return {}
    roles: dict[str, float] = {root_role: stats[root_pid][1]}
    tree = {root_pid}
    grew = True
    while grew:  # descendants: processes whose parent is in the tree
        grew = False
        for pid, (ppid, _) in stats.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    for pid in sorted(tree - {root_pid}):
        role = role_of(_cmdline(pid))
        roles[role] = roles.get(role, 0.0) + stats[pid][1]
    return roles


@dataclass
class CpuWindow:
    """CPU seconds per role between ``start()`` and ``stop()``, and the wall time between them."""

    root_pid: int
    root_role: str = "scheduler"
    before: dict[str, float] = field(default_factory=dict)
    used: dict[str, float] = field(default_factory=dict)
    wall_s: float = 0.0
    _t0: float = 0.0

    def start(self) -> CpuWindow:
        self.before, self._t0 = tree_cpu(self.root_pid, self.root_role), time.perf_counter()
        return self

    def stop(self) -> CpuWindow:
        after = tree_cpu(self.root_pid, self.root_role)
        self.wall_s = time.perf_counter() - self._t0
        self.used = {role: after[role] - self.before.get(role, 0.0) for role in after}
        return self

    def shares(self) -> dict[str, float]:
        """Each role's CPU time as a share of one core over the window (1.0: one core busy)."""
        return {role: used / self.wall_s for role, used in self.used.items()} if self.wall_s > 0 else {}


def describe(shares: dict[str, float]) -> str:
    """'gateway 0.41, scheduler 0.62, worker 0.98 cores busy' (``CpuWindow.shares`` and the like)."""
    return ", ".join(f"{role} {share:.2f}" for role, share in sorted(shares.items())) + " cores busy"
