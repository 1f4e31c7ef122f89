"""How the worker's MLX batches kernels into CUDA graphs.

MLX's CUDA backend collects kernels into a graph and launches it once the graph holds
``MLX_MAX_OPS_PER_BUFFER`` kernels or its kernels' inputs reach ``MLX_MAX_MB_PER_BUFFER``
million elements. Every paged decode kernel takes a KV-pool layer whole (it reads a few rows
through the slot table), so with a pool of production size the size limit commits a graph
every layer or two. Each commit is host time (graph update and launch) on the decode step's
critical path. The worker lifts the size limit; the kernel-count limit still splits steps.

MLX records each kernel into its graph by a stream capture of its own, host time per kernel
that a direct launch does not pay; the worker's steps are host-bound, so it launches directly
(``MLX_USE_CUDA_GRAPHS=0``) unless the user chose. Measured on an H200 (session 21,
docs/BENCHMARKS.md): 8B mixed traffic TPOT p50 18.8 / 21.2 ms without graphs against 22.4 /
24.9 with them (two runs, one in each order), 1B at 64 / 256 streams 13.6k / 31.4k tok/s
without against 9.9-11.4k / 20.9-28.2k with, a single stream level.
"""

from __future__ import annotations

from collections.abc import MutableMapping

SIZE_LIMIT_VAR = "MLX_MAX_MB_PER_BUFFER"
LIFTED_SIZE_LIMIT = 1_000_000  # million elements per graph: never reached by one decode step


GRAPHS_VAR = "MLX_USE_CUDA_GRAPHS"


def launch_directly(env: MutableMapping[str, str], cuda: bool) -> bool:
    """Turn MLX's CUDA graphs off in ``env`` (before the first device operation: MLX reads the
    switch once) on a CUDA device unless the user set it; whether it was set."""
    if not cuda or GRAPHS_VAR in env:
        return False
    env[GRAPHS_VAR] = "0"
    return True


def lift_graph_size_limit(env: MutableMapping[str, str], cuda: bool) -> bool:
    """Set the graph size limit in ``env`` (the worker's own environment, before its first
    device operation) on a CUDA device unless the user chose one; whether it was set."""
    if not cuda or SIZE_LIMIT_VAR in env:
        return False
    env[SIZE_LIMIT_VAR] = str(LIFTED_SIZE_LIMIT)
    return True
