"""Which BLAS this worker's CPU matrix products run on (it decides defaults that depend on it).

The Linux ``mlx-cpu`` wheel bundles the reference BLAS (``mlx_cpu.libs/libblas-*.so``);
``worker.blas = "auto"`` preloads a system OpenBLAS where one is installed
(``runtime/scheduler/blas.py``), whose ``cblas_*`` symbols then take MLX's calls. The two reward
different things: stacking a layer's projections into one product paid on the reference BLAS
(one call instead of three or two, the same per-element order) and cost on OpenBLAS.
Other libraries named like a BLAS may be mapped too without taking MLX's calls (numpy's wheel
maps its own OpenBLAS under prefixed symbols), so the test is where ``cblas_sgemm`` resolves.
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path

BUNDLED = "mlx_cpu.libs/libblas"  # the wheel's reference BLAS, as mapped


class _DlInfo(ctypes.Structure):
    _fields_ = [("dli_fname", ctypes.c_char_p), ("dli_fbase", ctypes.c_void_p),
                ("dli_sname", ctypes.c_char_p), ("dli_saddr", ctypes.c_void_p)]


def global_cblas() -> str | None:
    """The file of the ``cblas_sgemm`` the process's global scope resolves (a preloaded BLAS
    takes MLX's calls), or None if there is none."""
    try:
        process = ctypes.CDLL(None)
        symbol = process.cblas_sgemm
    except (AttributeError, OSError):
        return None
    info = _DlInfo()
    if not process.dladdr(ctypes.cast(symbol, ctypes.c_void_p), ctypes.byref(info)) or not info.dli_fname:
        return "?"
    return info.dli_fname.decode(errors="replace")


def is_reference(maps: str, cblas: str | None) -> bool:
    """Whether products run on the wheel's reference BLAS, given the process's mapped files
    (``/proc/self/maps`` text) and ``global_cblas()``: the bundled library is mapped and no other
    library's ``cblas_sgemm`` comes first."""
    return BUNDLED in maps and (cblas is None or BUNDLED in cblas)


def reference_blas() -> bool:
    """``is_reference`` for this process; False off Linux (macOS's Accelerate is fast) and when
    the maps cannot be read."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return False
    return is_reference(maps, global_cblas())
