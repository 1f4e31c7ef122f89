"""The paged decode kernel's attention-sink variant on a GPU: against MLX's own attention with
the same ``sinks`` (within the kernel's rounding, as its start-up check allows), and gpt-oss
served end to end through it. Runs only where MLX has a CUDA GPU; elsewhere reported as
skipped, not passed.
"""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from harness import InProcessService
from model_factory import make_model
from near_tie import assert_requests_like_mlx

from runtime.worker.paths.cuda.kernel_launch import launch_shape
from runtime.worker.paths.paged_attention import PagedAttention

pytestmark = pytest.mark.skipif(not PagedAttention.kernel_available(), reason="needs MLX on a CUDA GPU")


@pytest.mark.parametrize("context", [30, 3000])  # unsplit and split launches
@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(64, 8, 64), (8, 2, 128)])
def test_the_sink_kernel_matches_mlx_attention_with_sinks(n_q, n_kv, d, context):
    rng = np.random.default_rng(context + d)
    rows, tail = 3, 4
    slots = rows * context + 8
    def normal(shape, k):
        return mx.random.normal(shape, key=mx.random.key(context + k)).astype(mx.bfloat16)
    keys_pool, values_pool = normal((slots, n_kv, d), 0), normal((slots, n_kv, d), 1)
    pool_lengths = np.array([context, context // 2, 1], dtype=np.int32)
    table = np.zeros((rows, context), dtype=np.int32)
    for row in range(rows):
        table[row, : pool_lengths[row]] = rng.choice(np.arange(1, slots), pool_lengths[row], replace=False)
    queries = normal((rows, n_q, 1, d), 2)
    tail_k, tail_v = normal((rows, n_kv, tail + 2, d), 3), normal((rows, n_kv, tail + 2, d), 4)
    new_k, new_v = normal((rows, n_kv, 1, d), 5), normal((rows, n_kv, 1, d), 6)
    sinks = (3.0 * mx.random.normal((n_q,), key=mx.random.key(9))).astype(mx.bfloat16)
    lengths = mx.array(pool_lengths + tail + 1)
    launch = launch_shape(rows, n_kv, n_q // n_kv, d, context + tail + 1)
    out, _, _ = PagedAttention(True).attend_appending(
        queries, keys_pool, values_pool, mx.array(table), mx.arange(rows, dtype=mx.int32), lengths, tail_k, tail_v,
        mx.array([tail], dtype=mx.int32), new_k, new_v, d**-0.5, launch, sinks=sinks)
    keys = mx.concatenate([keys_pool[mx.array(table)].transpose(0, 2, 1, 3), tail_k[:, :, :tail], new_k], axis=2)
    values = mx.concatenate([values_pool[mx.array(table)].transpose(0, 2, 1, 3), tail_v[:, :, :tail], new_v], axis=2)
    valid = np.concatenate([np.arange(context)[None, :] < pool_lengths[:, None],
                            np.ones((rows, tail + 1), dtype=bool)], axis=1)
    ref = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=d**-0.5,
                                               mask=mx.array(valid)[:, None, None, :], sinks=sinks)
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert err < 2e-2, (launch, err)
    plain = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=d**-0.5,
                                                 mask=mx.array(valid)[:, None, None, :])
    assert mx.abs(out.astype(mx.float32) - plain.astype(mx.float32)).max().item() > 5e-2  # the sinks mattered


def test_gpt_oss_serves_mlx_lms_tokens_through_the_sink_kernel(tmp_path):
    """Windows of 64 (the decode tail fits) beside full layers, a drawn sink logit per head.

    Both experts run for every token: with a routing choice, a float32 rounding difference
    flips an expert and mlx-lm's own generation parts from its full forward by 0.1-0.5 nats on
    a GPU, batched or not, on any attention path (session 33's path_diff), which would hide
    what this test checks: the sink kernel's attention."""
    folder = make_model("gpt_oss", tmp_path / "gpt_oss", sliding_window=64, head_dim=64,
                        num_local_experts=2, num_experts_per_tok=2)
    svc = InProcessService(folder, max_running=8)
    assert svc.engine.paths.device_table is not None and svc.engine.paths.sinks  # the kernel path
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (120, 70, 40)]
    reqs = [svc.request(f"r{i}", p, 40) for i, p in enumerate(prompts)]
    svc.run({0: reqs[:2], 4: reqs[2:]})
    assert_requests_like_mlx(folder, reqs)
