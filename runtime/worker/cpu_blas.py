"""Which BLAS this worker's CPU matrix products run on (it decides defaults that depend on it).

The Linux ``mlx-cpu`` wheel bundles the reference BLAS; ``worker.blas = "auto"`` preloads a
system OpenBLAS where one is installed (``runtime/scheduler/blas.py``). The two reward
different things: stacking a layer's projections into one product paid on the reference BLAS
(one call instead of three or two, the same per-element order) and cost on OpenBLAS.
"""

from __future__ import annotations

import sys
from pathlib import Path

FAST_BLAS = ("openblas", "libmkl", "libblis", "accelerate")


def reference_blas(maps: str | None = None) -> bool:
    """True when this Linux process's BLAS is the wheel's reference one: no optimized BLAS
    among its mapped libraries (``maps``: ``/proc/self/maps`` text, read if not given). False
    off Linux (macOS's Accelerate is fast) and when the maps cannot be read."""
    if maps is None:
        if not sys.platform.startswith("linux"):
            return False
        try:
            maps = Path("/proc/self/maps").read_text()
        except OSError:
            return False
    lowered = maps.lower()
    return not any(name in lowered for name in FAST_BLAS)
