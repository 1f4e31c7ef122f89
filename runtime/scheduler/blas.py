"""Find a fast system BLAS for the worker on Linux CPUs.

The Linux `mlx-cpu` wheel bundles the reference BLAS; float32 matmuls run about 30x
faster with OpenBLAS. Preloading it (LD_PRELOAD) makes MLX's cblas calls use it.
"""

from __future__ import annotations

import ctypes.util
import os
import sys

CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/libopenblas.so.0",
    "/usr/lib/aarch64-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/lib/libopenblas.so.0",
)


def find_openblas() -> str | None:
    """Path of a system OpenBLAS, or None."""
    for path in CANDIDATES:
        if os.path.exists(path):
            return path
    found = ctypes.util.find_library("openblas")
    return found if found and os.path.isabs(found) else None


def worker_env(mode: str, env: dict[str, str]) -> dict[str, str]:
    """The worker's environment: with ``mode == "auto"`` on Linux, preload OpenBLAS when installed."""
    env = dict(env)
    if mode != "auto" or not sys.platform.startswith("linux"):
        return env
    lib = find_openblas()
    if lib is not None and lib not in env.get("LD_PRELOAD", ""):
        env["LD_PRELOAD"] = ":".join(p for p in (lib, env.get("LD_PRELOAD", "")) if p)
        # OpenBLAS threads spin while idle: leave a core to the scheduler (and clients).
        env.setdefault("OPENBLAS_NUM_THREADS", str(max(1, (os.cpu_count() or 2) - 1)))
    return env
