"""The paged decode kernel through ``window_view`` attends to a sliding window as MLX's own
attention does over the same positions (within the kernel's rounding, as its start-up check
allows). Runs only where MLX has a CUDA GPU; elsewhere reported as skipped, not passed.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime.worker.paths.cuda.kernel_launch import launch_shape
from runtime.worker.paths.cuda.window_view import window_view
from runtime.worker.paths.paged_attention import PagedAttention

pytestmark = pytest.mark.skipif(not PagedAttention.kernel_available(), reason="needs MLX on a CUDA GPU")


@pytest.mark.parametrize(("n_q", "n_kv", "d"), [(4, 1, 256), (8, 4, 128)])
@pytest.mark.parametrize("window", [64, 512])
def test_the_kernel_attends_to_the_window_only(n_q, n_kv, d, window):
    rng = np.random.default_rng(window + d)
    rows, context, tail = 4, 1500, 5
    slots = rows * context + 8
    def normal(shape, k):
        return mx.random.normal(shape, key=mx.random.key(window + k)).astype(mx.bfloat16)
    keys_pool, values_pool = normal((slots, n_kv, d), 0), normal((slots, n_kv, d), 1)
    pool_lengths = np.array([3, window - tail - 1, window + 40, context], dtype=np.int32)  # before the tail
    table = np.zeros((rows + 1, context), dtype=np.int32)
    order = np.array([2, 0, 4, 1], dtype=np.int32)
    for i, row in enumerate(order):
        table[row, : pool_lengths[i]] = rng.choice(np.arange(1, slots), pool_lengths[i], replace=False)
    queries = normal((rows, n_q, 1, d), 2)
    tail_k, tail_v = normal((rows, n_kv, tail + 3, d), 3), normal((rows, n_kv, tail + 3, d), 4)
    new_k, new_v = normal((rows, n_kv, 1, d), 5), normal((rows, n_kv, 1, d), 6)
    lengths = mx.array(pool_lengths + tail + 1)
    narrow, narrow_rows, narrow_lengths = window_view(mx.array(table), mx.array(order), lengths, window)
    launch = launch_shape(rows, n_kv, n_q // n_kv, d, int(lengths.max().item()))
    out, _, _ = PagedAttention(True).attend_appending(
        queries, keys_pool, values_pool, narrow, narrow_rows, narrow_lengths, tail_k, tail_v,
        mx.array([tail], dtype=mx.int32), new_k, new_v, d**-0.5, launch)
    # MLX's attention over every position, masked to each row's last ``window``.
    gathered = mx.array(table[order])
    keys = mx.concatenate([keys_pool[gathered].transpose(0, 2, 1, 3), tail_k[:, :, :tail], new_k], axis=2)
    values = mx.concatenate([values_pool[gathered].transpose(0, 2, 1, 3), tail_v[:, :, :tail], new_v], axis=2)
    position = np.concatenate([np.broadcast_to(np.arange(context), (rows, context)),
                               pool_lengths[:, None] + np.arange(tail + 1)[None, :]], axis=1)
    total = (pool_lengths + tail + 1)[:, None]
    in_pool = np.concatenate([np.arange(context)[None, :] < pool_lengths[:, None],
                              np.ones((rows, tail + 1), dtype=bool)], axis=1)
    valid = in_pool & (position >= total - window)
    ref = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=d**-0.5,
                                               mask=mx.array(valid)[:, None, None, :])
    err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
    assert err < 2e-2, err
    # And not what attending to every position gives, for the rows longer than the window.
    full = mx.fast.scaled_dot_product_attention(queries, keys, values, scale=d**-0.5,
                                                mask=mx.array(in_pool)[:, None, None, :])
    far = mx.abs(out.astype(mx.float32) - full.astype(mx.float32)).max(axis=(1, 2, 3))
    assert far[2].item() > 5e-2 and far[3].item() > 5e-2


def test_a_windowed_model_serves_mlx_lms_tokens_through_the_kernel(tmp_path):
    """End to end on the GPU: Gemma 3 with a 64-position window (the decode tail fits), prompts
    past it and generations crossing it, batched, with a prefix hit longer than it."""
    import random

    from harness import InProcessService
    from model_factory import make_model
    from near_tie import assert_requests_like_mlx

    window = 64
    # A head width the kernel takes (a multiple of 32).
    folder = make_model("gemma3_text", tmp_path / "gemma3", sliding_window=window, head_dim=64, query_pre_attn_scalar=64)
    svc = InProcessService(folder, max_running=8)
    assert svc.engine.paths.device_table is not None and svc.engine.paths.tail is not None  # the kernel path
    rng = random.Random(7)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (150, 90, window - 20, 200)]
    reqs = [svc.request(f"r{i}", p, 48) for i, p in enumerate(prompts)]
    svc.run({0: reqs[:3], 5: reqs[3:]})
    hit = svc.request("hit", prompts[0][:120] + [5, 6, 7], 40)
    svc.run({0: [hit]})
    assert hit.prefix_len >= 100
    assert_requests_like_mlx(folder, reqs + [hit])
