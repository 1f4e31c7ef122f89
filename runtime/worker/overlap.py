"""When the worker submits a step before reading the previous one back."""

from __future__ import annotations


def overlap_submit(on_gpu: bool, pool_bytes: int, limit_mb: int, compiled: bool = False) -> bool:
    """Whether to submit a step before reading the previous one back (see WorkerConfig).

    On a GPU: where the pools are small enough that copying them is cheaper than the launch
    gap. On the CPU: with compiled decode. MLX's CPU stream runs only about 100 operations
    behind the host, so when step N+1's layer-i write is queued, step N's layer i has long
    finished and the write stays in place; the host's work between steps (the socket, the
    next plan) then overlaps the device's instead of leaving it idle.
    """
    if on_gpu:
        return pool_bytes <= limit_mb * 2**20
    return compiled
