"""How the worker's MLX batches kernels into CUDA graphs.

MLX's CUDA backend collects kernels into a graph and launches it once the graph holds
``MLX_MAX_OPS_PER_BUFFER`` kernels or its kernels' inputs reach ``MLX_MAX_MB_PER_BUFFER``
million elements. Every paged decode kernel takes a KV-pool layer whole (it reads a few rows
through the slot table), so with a pool of production size the size limit commits a graph
every layer or two. Each commit is host time (graph update and launch) on the decode step's
critical path. The worker lifts the size limit; the kernel-count limit still splits steps.
"""

from __future__ import annotations

from collections.abc import MutableMapping

SIZE_LIMIT_VAR = "MLX_MAX_MB_PER_BUFFER"
LIFTED_SIZE_LIMIT = 1_000_000  # million elements per graph: never reached by one decode step


def lift_graph_size_limit(env: MutableMapping[str, str], cuda: bool) -> bool:
    """Set the graph size limit in ``env`` (the worker's own environment, before its first
    device operation) on a CUDA device unless the user chose one; whether it was set."""
    if not cuda or SIZE_LIMIT_VAR in env:
        return False
    env[SIZE_LIMIT_VAR] = str(LIFTED_SIZE_LIMIT)
    return True
