"""The CUDA paged decode kernels themselves (the CPU tests replace them with references).

These run only where MLX has a CUDA GPU (the lent H200: ``python3 -m pytest -q
tests/test_paged_kernel_cuda.py``); elsewhere they are reported as skipped, not passed.
"""

from __future__ import annotations

import itertools

import mlx.core as mx
import numpy as np
import pytest

from runtime.worker.paths.cuda.kernel_launch import launch_shape
from runtime.worker.paths.paged_attention import PagedAttention

pytestmark = pytest.mark.skipif(not PagedAttention.kernel_available(), reason="needs MLX on a CUDA GPU")


def _case(rows: int, n_q: int, n_kv: int, d: int, context: int, tail: int, seed: int):
    rng = np.random.default_rng(seed)
    slots = rows * context + 8
    keys_pool = mx.random.normal((slots, n_kv, d), key=mx.random.key(seed)).astype(mx.bfloat16)
    values_pool = mx.random.normal((slots, n_kv, d), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    lengths = rng.integers(1, context + 1, rows)
    table = np.zeros((rows + 2, context), dtype=np.int32)
    order = rng.permutation(rows + 2)[:rows].astype(np.int32)
    for i, row in enumerate(order):
        table[row, : lengths[i]] = rng.choice(np.arange(1, slots), lengths[i], replace=False)
    def normal(shape, k):
        return mx.random.normal(shape, key=mx.random.key(seed + k)).astype(mx.bfloat16)
    queries = normal((rows, n_q, 1, d), 2)
    # A tail of capacity tail + 3 holding ``tail`` positions: the kernels must not read the rest.
    tail_k, tail_v = normal((rows, n_kv, tail + 3, d), 3), normal((rows, n_kv, tail + 3, d), 4)
    new_k, new_v = normal((rows, n_kv, 1, d), 5), normal((rows, n_kv, 1, d), 6)
    total = mx.array((lengths + tail + 1).astype(np.int32))
    pool_args = (queries, keys_pool, values_pool, mx.array(table), mx.array(order), total)
    return pool_args, (tail_k, tail_v, new_k, new_v), lengths


@pytest.mark.parametrize(("loop", "unroll"), [("pipelined", 1), ("classic", 1), ("mma", 1), ("mma_ahead", 1)])
@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(32, 8, 64), (32, 8, 128), (16, 2, 128), (8, 8, 64), (16, 4, 96)])
def test_the_appending_kernel_equals_reading_a_concatenated_tail(n_q, n_kv, d, loop, unroll):
    attention = PagedAttention(True, loop=loop, unroll=unroll)
    for rows, (context, tail) in itertools.product((1, 5), ((40, 2), (700, 9))):
        pool_args, (tail_k, tail_v, new_k, new_v), lengths = _case(rows, n_q, n_kv, d, context, tail, rows + context)
        keys = mx.concatenate([tail_k[:, :, :tail], new_k], axis=2)
        values = mx.concatenate([tail_v[:, :, :tail], new_v], axis=2)
        tail_len = mx.array([tail], dtype=mx.int32)
        for max_length in (0, context + tail + 1):
            launch = launch_shape(rows, n_kv, n_q // n_kv, d, max_length)
            out, out_k, out_v = attention.attend_appending(*pool_args, tail_k, tail_v, tail_len, new_k, new_v,
                                                           d**-0.5, launch)
            assert out_k.shape == tail_k.shape and out_v.shape == tail_v.shape  # the tail keeps its capacity
            assert mx.array_equal(out_k[:, :, : tail + 1], keys) and mx.array_equal(out_v[:, :, : tail + 1], values)
            expected = attention._kernel_attend(*pool_args, out_k, out_v, tail_len + 1, d**-0.5, launch)
            assert mx.array_equal(out, expected), launch  # the same arithmetic in the same order
            # Against MLX's own attention over the gathered positions (rounding differs).
            q, kp, vp, table, order, _ = pool_args
            gathered_k = mx.concatenate([kp[table[order]].transpose(0, 2, 1, 3), keys], axis=2)
            gathered_v = mx.concatenate([vp[table[order]].transpose(0, 2, 1, 3), values], axis=2)
            valid = np.concatenate([np.arange(context)[None, :] < lengths[:, None],
                                    np.ones((rows, tail + 1), dtype=bool)], axis=1)
            ref = mx.fast.scaled_dot_product_attention(q, gathered_k, gathered_v, scale=d**-0.5,
                                                       mask=mx.array(valid)[:, None, None, :])
            err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
            assert err < 2e-2, (launch, err)


def test_the_first_step_after_a_flush_appends_to_an_empty_tail():
    attention = PagedAttention(True)
    pool_args, (tail_k, tail_v, new_k, new_v), _ = _case(3, 32, 8, 64, 100, 0, 7)
    launch = launch_shape(3, 8, 4, 64, 101)
    one = mx.array([1], dtype=mx.int32)
    alone = attention._kernel_attend(*pool_args, new_k, new_v, one, 0.125, launch)  # the step's K/V as the tail
    out, out_k, out_v = attention.attend_appending(*pool_args, tail_k, tail_v, one - 1, new_k, new_v, 0.125, launch)
    assert mx.array_equal(out_k[:, :, :1], new_k) and mx.array_equal(out_v[:, :, :1], new_v)
    assert mx.array_equal(out, alone)
    # Without a tail at all (a model without a DecodeTail) the step's K/V are returned as it.
    out, out_k, out_v = attention.attend_appending(*pool_args, None, None, None, new_k, new_v, 0.125, launch)
    assert out_k is new_k and out_v is new_v and mx.array_equal(out, alone)


ROPE_SPECS = {  # (dims, traditional, scale, base or None, frequencies or None) at head dim 128
    "base": (128, False, 1.0, 500000.0, None),
    "base-scaled": (128, False, 0.25, 10000.0, None),
    "partial-traditional": (64, True, 1.0, 10000.0, None),
    "freqs": (128, False, 1.0, None, "llama3"),
}


@pytest.mark.parametrize("name", sorted(ROPE_SPECS))
@pytest.mark.parametrize("loop", ["mma", "mma_ahead", "pipelined"])
def test_the_rotating_kernel_matches_mlx_rope_bit_for_bit(name, loop):
    """The kernel's own RoPE (``kernel_rope``) against ``mx.fast.rope``: the rotating kernel's
    output and appended tail equal the plain kernel's fed MLX's rotations, bit for bit, for
    one row and a batch, unsplit and split, at positions up to 128k (``check_kernel_rope``)."""
    from runtime.worker.model.kernel_rope import BASE, FREQS, RopeSpec
    from runtime.worker.paths.cuda.kernel_check import check_kernel_rope

    dims, traditional, scale, base, freqs = ROPE_SPECS[name]
    if freqs is not None:
        from mlx_lm.models.rope_utils import Llama3RoPE

        module = Llama3RoPE(dims, 131072, False, 500000.0, scaling_config={
            "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
        freqs = mx.contiguous(module._freqs.astype(mx.float32))
    spec = RopeSpec(FREQS if freqs is not None else BASE, dims, traditional, scale, base, freqs)
    attention = PagedAttention(True, loop=loop)
    problem = check_kernel_rope(attention, mx.bfloat16, 8, 4, 128, (spec,), [(1, 4), (4, 4)], 131072)
    assert problem is None, problem
