"""Where MLX's CUDA backend keeps the kernels it compiles at run time (NVRTC output).

A fresh service on a GPU builds its kernels on first use: tens of seconds for the paged
decode kernels, the sampler's gathers and each new decode shape. MLX caches what it builds
under ``MLX_PTX_CACHE_DIR``, by default ``/tmp/mlx/<version>/ptx``: lost with ``/tmp`` and
shared by every GPU kind of the host. The worker keeps it under the user's cache directory
instead, one folder per MLX version and GPU, so a restart (or a reboot) finds its kernels.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, MutableMapping
from pathlib import Path

CACHE_VAR = "MLX_PTX_CACHE_DIR"


def kernel_cache_dir(env: Mapping[str, str], mlx_version: str, device_name: str) -> Path:
    """``$XDG_CACHE_HOME`` (else ``~/.cache``) / runtime / mlx-kernels / version / device."""
    base = Path(env["XDG_CACHE_HOME"]) if env.get("XDG_CACHE_HOME") else Path(env.get("HOME", "~")).expanduser() / ".cache"
    device = re.sub(r"[^A-Za-z0-9._-]+", "-", device_name).strip("-") or "gpu"
    return base / "runtime" / "mlx-kernels" / mlx_version / device


def keep_kernel_cache(env: MutableMapping[str, str], cuda: bool, mlx_version: str, device_name: str) -> str | None:
    """Point ``env`` (the worker's own, before its first kernel build) at the lasting cache on
    a CUDA device unless the user chose a directory; the directory set, else None."""
    if not cuda or CACHE_VAR in env:
        return None
    path = kernel_cache_dir(env, mlx_version, device_name)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError:
        return None  # MLX's own default then
    env[CACHE_VAR] = str(path)
    return str(path)
