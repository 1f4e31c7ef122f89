"""When the worker submits a step before reading the previous one back."""

from __future__ import annotations

from runtime.worker.overlap import overlap_submit


def test_overlap_submit_on_gpu_with_small_pools_and_on_cpu_when_compiled():
    assert overlap_submit(True, 100 * 2**20, 1024)
    assert not overlap_submit(True, 2048 * 2**20, 1024)  # a big pool: copying it each write costs more
    assert not overlap_submit(False, 1, 1024)  # CPU, graph built layer by layer: read back first
    assert overlap_submit(False, 2048 * 2**20, 1024, compiled=True)  # CPU, compiled decode


def test_buffer_cache_limit_is_raised_but_never_lowered():
    from runtime.worker.loader import buffer_cache_bytes

    mib = 2**20
    assert buffer_cache_bytes(64, 32 * mib, 10 * mib) == 64 * mib  # configured
    assert buffer_cache_bytes(0, 32 * mib, 100 * mib) == 400 * mib  # four pools' worth
    assert buffer_cache_bytes(0, 32 * mib, 1 * mib) == 32 * mib  # never below MLX's default
    assert buffer_cache_bytes(0, 16 * 2**30, 1 * mib) == 16 * 2**30


def test_row_buckets():
    from runtime.worker.paths.decode_plan import row_bucket

    sizes = (1, 2, 3, 5, 8, 9, 16, 17, 64, 65, 100, 256, 257, 300)
    assert [row_bucket(n) for n in sizes] == [1, 2, 4, 8, 8, 16, 16, 32, 64, 96, 128, 256, 320, 320]
    assert len({row_bucket(n) for n in range(1, 257)}) == 14  # classes a 256-row service traces


def test_decode_plan_paths():
    from runtime.protocol.worker import DecodeBatch
    from runtime.worker.paths.decode_plan import plan_decode

    lockstep = DecodeBatch(rows=[0, 1, 2], token_ids=[-1] * 3, positions=[40, 40, 40], slot_ids=[5, 6, 7],
                           temperatures=[0.0] * 3)
    plan = plan_decode(lockstep, dense=True, length_bucket=128, max_context=512, padding_row=16)
    assert (plan.pad, plan.length, plan.compact, plan.lockstep) == (0, 41, True, True)
    scattered = DecodeBatch(rows=[2, 0, 1], token_ids=[-1] * 3, positions=[40, 41, 9], slot_ids=[5, 6, 7],
                            temperatures=[0.0] * 3)
    plan = plan_decode(scattered, dense=True, length_bucket=128, max_context=512, padding_row=16)
    assert (plan.pad, plan.length, plan.compact, plan.lockstep) == (0, 42, False, False)
    assert plan.valid().sum(axis=1).tolist() == [41, 42, 10]
    # Pool paths: rows padded to a bucket (padding row, position 0, slot 0), length rounded up.
    plan = plan_decode(scattered, dense=False, length_bucket=128, max_context=512, padding_row=16)
    assert (plan.pad, plan.length) == (1, 128)
    assert plan.rows.tolist() == [2, 0, 1, 16] and plan.positions.tolist() == [40, 41, 9, 0]
    assert plan.slot_ids == [5, 6, 7, 0]


def test_length_buckets():
    from runtime.worker.paths.decode_plan import bucket_lengths, round_length

    assert [round_length(n, 32, 100) for n in (1, 32, 33, 96, 97, 100)] == [32, 32, 64, 96, 100, 100]
    assert bucket_lengths(32, 100) == [32, 64, 96, 100]
    assert bucket_lengths(32, 96) == [32, 64, 96]
