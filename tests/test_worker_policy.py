"""When the worker submits a step before reading the previous one back."""

from __future__ import annotations

from runtime.worker.engine import Engine


def test_overlap_submit_only_on_gpu_with_small_pools():
    assert Engine.overlap_submit(True, 100 * 2**20, 1024)
    assert not Engine.overlap_submit(True, 2048 * 2**20, 1024)  # a big pool: copying it each write costs more
    assert not Engine.overlap_submit(False, 1, 1024)  # CPU: always read back first
