"""Which loop the paged kernel builds for a shape (``PagedAttention.loop_for``): the tensor-core
loops only where their products and fragments apply, else the loop they fall back to."""

from __future__ import annotations

import mlx.core as mx
import pytest

from runtime.worker.paths import paged_attention
from runtime.worker.paths.cuda.kernel_launch import MMA_MAX_WARPS, loop_warps
from runtime.worker.paths.paged_attention import PagedAttention


@pytest.mark.parametrize(("loop", "dtype", "n_rep", "head_dim", "tensor_cores", "expected"), [
    ("pipelined", mx.bfloat16, 4, 128, True, "pipelined"),
    ("classic", mx.float32, 4, 128, False, "classic"),
    ("mma", mx.bfloat16, 4, 128, True, "mma"),
    ("mma", mx.float16, 8, 64, True, "mma"),
    ("mma", mx.float32, 4, 128, True, "pipelined"),  # no 4-byte products
    ("mma", mx.bfloat16, 4, 72, True, "pipelined"),  # not a head dim of 16s
    ("mma", mx.bfloat16, 16, 128, True, "pipelined"),  # more query heads than an n-tile's 8
    ("mma", mx.bfloat16, 4, 128, False, "pipelined"),  # before sm_80
    ("mma_ahead", mx.bfloat16, 4, 128, True, "mma_ahead"),
    ("mma", mx.bfloat16, 2, 256, True, "pipelined"),  # a lane's K/V words of 256-wide rows spill
    ("mma_ahead", mx.bfloat16, 2, 256, True, "pipelined"),
    ("mma_ahead", mx.bfloat16, 4, 128, False, "pipelined"),
])
def test_loop_for(monkeypatch, loop, dtype, n_rep, head_dim, tensor_cores, expected):
    monkeypatch.setattr(paged_attention, "_tensor_cores", lambda: tensor_cores)
    assert PagedAttention(False, loop=loop).loop_for(dtype, n_rep, head_dim) == expected


def test_the_mma_loops_launch_at_most_their_warps():
    # 16 warps of 182-255 registers a lane exceed the register file: such a launch fails.
    assert [loop_warps("mma", w, 128) for w in (4, 8, 16)] == [4, 8, MMA_MAX_WARPS]
    assert loop_warps("mma_ahead", 16, 128) == loop_warps("mma_ahead", 16, 64) == MMA_MAX_WARPS == 8
    assert loop_warps("mma", 16, 64) == 16  # about 96 registers at head dim 64
    assert loop_warps("pipelined", 16, 128) == 16
    # split blocks of the mma loops past head dim 64: half the launch shape's warps
    assert [loop_warps("mma_ahead", w, 128, split=True) for w in (2, 4, 8, 16)] == [2, 4, 4, 8]
    assert loop_warps("mma", 8, 128, split=True) == 4 and loop_warps("mma", 16, 64, split=True) == 16
    assert loop_warps("pipelined", 8, 128, split=True) == 8


def test_split_launches_take_their_own_loop(monkeypatch):
    monkeypatch.setattr(paged_attention, "_tensor_cores", lambda: True)
    monkeypatch.setattr(paged_attention, "LOOP", "pipelined")
    monkeypatch.setattr(paged_attention, "SPLIT_LOOP", "mma")  # as use-best-loop could set them
    attention = PagedAttention(False)  # the worker's loops
    assert attention.loop_for(mx.bfloat16, 4, 128, split=True) == "mma"
    assert attention.loop_for(mx.bfloat16, 4, 128, split=False) == "pipelined"
    assert attention.loop_for(mx.float32, 4, 128, split=True) == "pipelined"  # mma's own limits still hold
    same = PagedAttention(False, loop="mma_ahead")  # one loop for both when told one
    assert same.loop_for(mx.bfloat16, 4, 128, split=True) == same.loop_for(mx.bfloat16, 4, 128) == "mma_ahead"
    assert same.loop_for(mx.bfloat16, 4, 64, split=True) == "mma_ahead"  # at every head dim
    with pytest.raises(ValueError):
        PagedAttention(False, loop="ring9")


def test_split_launches_of_small_head_dims_take_their_own_loop(monkeypatch):
    monkeypatch.setattr(paged_attention, "_tensor_cores", lambda: True)
    monkeypatch.setattr(paged_attention, "SPLIT_LOOP", "mma_ahead")
    monkeypatch.setattr(paged_attention, "SPLIT_LOOP_SMALL_DIMS", "mma")
    attention = PagedAttention(False)
    assert attention.loop_for(mx.bfloat16, 4, 64, split=True) == "mma"  # the 1B's heads
    assert attention.loop_for(mx.bfloat16, 4, 128, split=True) == "mma_ahead"
    assert attention.loop_for(mx.bfloat16, 4, 64, split=False) == paged_attention.LOOP


@pytest.mark.parametrize(("launch", "head_dim", "kind", "warps"), [
    ((32, 8), 128, "split", 4),  # the 8B's long row: mma_ahead at half the warps
    ((1, 4), 128, "single", 4),
    ((4, 16), 64, "split", 16),  # the 1B's: mma keeps its 16
])
def test_a_launch_builds_the_loop_and_warps_it_names(monkeypatch, launch, head_dim, kind, warps):
    """What ``_launch`` asks to build and launch (the kernels themselves are CUDA only)."""
    monkeypatch.setattr(paged_attention, "_tensor_cores", lambda: True)
    asked = []

    def kernel(self, which, appending, loop="", rope=False, sinks=False):
        def launched(**kwargs):
            asked.append((which, loop, kwargs["threadgroup"][0] // 32))
            return [mx.zeros(shape, dtype) for shape, dtype in zip(kwargs["output_shapes"], kwargs["output_dtypes"])]
        return launched

    monkeypatch.setattr(PagedAttention, "_kernel", kernel)
    attention = PagedAttention(False)
    queries = mx.zeros((1, 32, 1, head_dim), dtype=mx.bfloat16)
    attention._launch([queries], 8, launch)
    expected_loop = attention.loop_for(mx.bfloat16, 4, head_dim, split=kind == "split")
    assert asked[0] == (kind, expected_loop, warps)
