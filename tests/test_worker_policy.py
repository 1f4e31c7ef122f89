"""When the worker submits a step before reading the previous one back."""

from __future__ import annotations

from runtime.worker.engine import Engine


def test_overlap_submit_only_on_gpu_with_small_pools():
    assert Engine.overlap_submit(True, 100 * 2**20, 1024)
    assert not Engine.overlap_submit(True, 2048 * 2**20, 1024)  # a big pool: copying it each write costs more
    assert not Engine.overlap_submit(False, 1, 1024)  # CPU: always read back first


def test_buffer_cache_limit_is_raised_but_never_lowered():
    from runtime.worker.loader import buffer_cache_bytes

    assert buffer_cache_bytes(64, 32 * 2**20) == 64 * 2**20  # configured
    auto = buffer_cache_bytes(0, 32 * 2**20)
    assert 32 * 2**20 <= auto <= 8 * 2**30
    assert buffer_cache_bytes(0, 16 * 2**30) == 16 * 2**30  # a larger MLX default stays
