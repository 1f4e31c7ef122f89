"""Device memory of a loaded model with and without fused projections, one process per way.

    python3 scripts/fusion_memory.py --shape llama-1b       # writes the synthetic model once

Ways: ``off`` (the loader, no fusion), ``loader`` (the loader fusing from lazily loaded
weights, what the worker does), ``eager`` (every weight loaded first, then fused). Prints MLX's
active memory and, on a CUDA machine, what ``nvidia-smi`` reports for the process: a CUDA
memory pool keeps buffers given back to it reserved, so the two can differ.
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def device_mib() -> int:
    """This process's GPU memory per nvidia-smi, or -1 without one."""
    from runtime.bench.service import gpu_memory_bytes

    per_pid = gpu_memory_bytes()
    return -1 if per_pid is None else per_pid.get(os.getpid(), 0) // 2**20


def measure(folder: str, way: str) -> None:
    import mlx.core as mx

    from runtime.config import parse_config
    from runtime.worker.loader import load
    from runtime.worker.model.fused_projections import fuse_projections

    setting = "off" if way in ("off", "eager") else "on"
    loaded = load(parse_config({"model": {"path": folder}, "worker": {"fuse_projections": setting}}))
    groups = loaded.fused_groups
    if way == "eager":
        groups = fuse_projections(loaded.model)
    gc.collect()
    mx.clear_cache()
    mx.synchronize()
    print(f"{way:7s} groups {groups:3d}  MLX active {mx.get_active_memory() / 2**20:8.0f} MiB  "
          f"peak {mx.get_peak_memory() / 2**20:8.0f} MiB  nvidia-smi {device_mib():6d} MiB", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--work-dir", type=Path, default=Path("/tmp/runtime-bench"))
    p.add_argument("--measure", nargs=2, metavar=("FOLDER", "WAY"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.measure:
        measure(*args.measure)
        return
    sys.path.insert(0, str(ROOT))
    from runtime.bench.models import synthetic_model

    folder = synthetic_model(args.shape, args.work_dir, log=print)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))}
    for way in ("off", "loader", "eager"):
        subprocess.run([sys.executable, __file__, "--measure", str(folder), way], env=env, check=True)


if __name__ == "__main__":
    main()
