"""Keep the bench's client processes off the service's CPU cores (``--pin-clients``).

A host-bound service (the worker encoding a step's kernels) slows down when client
processes share its physical cores (SMT siblings, caches). In production the clients are
elsewhere; the bench can mimic that by giving the service one half of the physical cores (both
hardware threads of each) and the client processes the other half. Linux only.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path


def physical_cores() -> list[list[int]]:
    """The CPUs this process may use, grouped by physical core (hardware threads together)."""
    allowed = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    cores: dict[tuple[str, str], list[int]] = {}
    for cpu in allowed:
        topo = Path(f"/sys/devices/system/cpu/cpu{cpu}/topology")
        try:
            key = ((topo / "physical_package_id").read_text().strip(), (topo / "core_id").read_text().strip())
        except OSError:
            key = ("", str(cpu))
        cores.setdefault(key, []).append(cpu)
    return sorted(cores.values())


def split_cpus() -> tuple[set[int], set[int]] | None:
    """(service CPUs, client CPUs): the first and second half of the physical cores; None
    with fewer than four physical cores (nothing left to split) or off Linux."""
    cores = physical_cores()
    if len(cores) < 4:
        return None
    half = len(cores) // 2
    return {c for core in cores[:half] for c in core}, {c for core in cores[half:] for c in core}


@contextmanager
def pinned(cpus: set[int] | None) -> Iterator[None]:
    """Within the block, this process (and the processes it starts) runs on ``cpus`` only;
    None: unchanged."""
    if not cpus or not hasattr(os, "sched_setaffinity"):
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)
