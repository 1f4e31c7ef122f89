"""When the worker submits a step before reading the previous one back."""

from __future__ import annotations

from runtime.worker.engine import Engine


def test_overlap_submit_only_on_gpu_with_small_pools():
    assert Engine.overlap_submit(True, 100 * 2**20, 1024)
    assert not Engine.overlap_submit(True, 2048 * 2**20, 1024)  # a big pool: copying it each write costs more
    assert not Engine.overlap_submit(False, 1, 1024)  # CPU: always read back first


def test_buffer_cache_limit_is_raised_but_never_lowered():
    from runtime.worker.loader import buffer_cache_bytes

    mib = 2**20
    assert buffer_cache_bytes(64, 32 * mib, 10 * mib) == 64 * mib  # configured
    assert buffer_cache_bytes(0, 32 * mib, 100 * mib) == 400 * mib  # four pools' worth
    assert buffer_cache_bytes(0, 32 * mib, 1 * mib) == 32 * mib  # never below MLX's default
    assert buffer_cache_bytes(0, 16 * 2**30, 1 * mib) == 16 * 2**30


def test_row_buckets():
    from runtime.worker.engine import row_bucket

    assert [row_bucket(n) for n in (1, 2, 3, 5, 8, 9, 16, 17, 64)] == [1, 2, 4, 8, 8, 16, 16, 24, 64]
