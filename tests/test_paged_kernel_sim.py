"""The CUDA paged decode kernels' arithmetic and indexing, run on the CPU (``cuda_sim``).

``test_paged_kernel_cuda.py`` runs the same sources on a GPU; this runs them everywhere g++
builds C++20, one thread per CUDA lane, against a float64 reference.
"""

from __future__ import annotations

import pytest
from cuda_sim import run_paged_kernel, unavailable

UNAVAILABLE = unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"cannot simulate the CUDA kernels: {UNAVAILABLE}")

TOLERANCE = {"float": 1e-4, "bf16": 2e-2}  # bf16: the output is rounded to bf16

# Every (loop, appending, splits) once or more; every dtype, unroll, head dim and warp count
# among them. Head dim 96 in bf16 takes the loads that are not whole 16-byte words.
CASES = [
    ("pipelined", False, 1, "float", 1, 128, 2, 4),
    ("pipelined", False, 3, "bf16", 2, 64, 4, 2),
    ("pipelined", True, 1, "bf16", 1, 96, 2, 4),
    ("pipelined", True, 3, "float", 2, 128, 2, 2),
    ("classic", False, 1, "bf16", 1, 64, 4, 2),
    ("classic", False, 3, "float", 2, 96, 2, 4),
    ("classic", True, 1, "float", 2, 64, 4, 4),
    ("classic", True, 3, "bf16", 1, 128, 2, 2),
    ("pipelined", False, 3, "bf16", 2, 96, 2, 2),
    ("classic", True, 1, "bf16", 2, 96, 2, 4),
    ("pipelined", True, 3, "bf16", 1, 64, 4, 4),
    ("classic", False, 3, "bf16", 1, 128, 4, 4),
    ("mma", False, 1, "bf16", 1, 128, 4, 4),
    ("mma", True, 3, "bf16", 1, 128, 4, 2),
    ("mma", True, 1, "bf16", 1, 64, 8, 4),
    ("mma", False, 3, "bf16", 1, 96, 2, 2),
    ("mma", True, 3, "bf16", 1, 64, 1, 8),
    ("mma", True, 3, "bf16", 1, 256, 2, 2),  # Gemma's head dim: 32 output tiles
    ("mma_ahead", False, 1, "bf16", 1, 128, 4, 4),
    ("mma_ahead", True, 3, "bf16", 1, 96, 2, 2),
    ("mma_ahead", True, 1, "bf16", 1, 64, 8, 2),
    ("mma_ahead", True, 3, "bf16", 1, 128, 4, 4),  # the 8B's long rows: split blocks of 4 warps (loop_warps)
]


@pytest.mark.parametrize(("loop", "appending", "splits", "dtype", "unroll", "head_dim", "n_rep", "warps"), CASES)
def test_the_kernel_matches_the_reference(loop: str, appending: bool, splits: int, dtype: str, unroll: int,
                                          head_dim: int, n_rep: int, warps: int) -> None:
    # Several warp passes per block; then so few positions that some splits and warps are empty.
    for context, tail, seed in ((200, 3, 0), (2, 1, 1)):
        err, tail_exact = run_paged_kernel(loop, appending, splits, dtype=dtype, head_dim=head_dim, n_rep=n_rep,
                                           warps=warps, unroll=unroll, context=context, tail=tail, seed=seed)
        assert err < TOLERANCE[dtype], f"context {context}, tail {tail}: error {err:.3g}"
        assert tail_exact, f"context {context}, tail {tail}: the appended tail differs"


def test_more_splits_than_a_combine_block_has_threads() -> None:
    # The combine block has one thread per head dim (64): splits 64-71 are read by a second pass.
    # 717 pool positions and 3 in the tail: 72 splits of 10 positions, none empty.
    err, _ = run_paged_kernel("mma", False, 72, dtype="bf16", head_dim=64, n_rep=2, warps=2, context=717, tail=3,
                              full=True)
    assert err < TOLERANCE["bf16"], f"error {err:.3g}"


def test_a_wrong_softmax_is_caught() -> None:
    def unshifted(source: str) -> str:
        assert "expf(s[u] - mn)" in source
        return source.replace("expf(s[u] - mn)", "expf(s[u])")

    err, _ = run_paged_kernel("pipelined", False, 1, context=200, edit=unshifted)
    assert err > 100 * TOLERANCE["float"]


@pytest.mark.parametrize(("loop", "head_dim", "n_rep"),
                         [("mma", 128, 1), ("mma", 128, 4), ("mma", 64, 8), ("mma", 96, 2), ("mma_ahead", 128, 4),
                          ("mma_ahead", 96, 8)])
def test_the_mma_loops_over_many_passes_match_the_reference(loop: str, head_dim: int, n_rep: int) -> None:
    # About 30 passes a warp (odd and even counts): each rescales the output kept from the ones before.
    for context in (1000, 1016):
        err, tail_exact = run_paged_kernel(loop, True, 1, dtype="bf16", head_dim=head_dim, n_rep=n_rep, warps=2,
                                           context=context)
        assert err < TOLERANCE["bf16"] and tail_exact, f"context {context}: error {err:.3g}"


def test_a_wrong_rescale_in_the_mma_loop_is_caught() -> None:
    def other_head(source: str) -> str:  # head 2 q4 rescaled by head 2 q4 + 1's factor
        old = "__shfl_sync(0xffffffff, corr, 8 * q4);"
        assert old in source
        return source.replace(old, "__shfl_sync(0xffffffff, corr, 8 * q4 + 4);")

    err, _ = run_paged_kernel("mma", True, 1, dtype="bf16", n_rep=4, warps=2, context=1000, edit=other_head)
    assert err > 5 * TOLERANCE["bf16"]


def test_a_wrong_mma_fragment_is_caught() -> None:
    def swapped(source: str) -> str:
        old = "__byte_perm(vw[2][mt], vw[3][mt], 0x5410), __byte_perm(vw[2][mt], vw[3][mt], 0x7632)"
        assert old in source  # V^T's fragment of positions 8-15: dims vdim and vdim + 1 exchanged
        return source.replace(old, "__byte_perm(vw[2][mt], vw[3][mt], 0x7632), __byte_perm(vw[2][mt], vw[3][mt], 0x5410)")

    err, _ = run_paged_kernel("mma", False, 1, dtype="bf16", n_rep=4, context=200, edit=swapped)
    assert err > 10 * TOLERANCE["bf16"]


def test_the_mma_loop_without_aligned_pointers_matches_the_reference() -> None:
    def unaligned(source: str) -> str:  # the element-by-element loads a misaligned buffer takes
        assert "const bool aligned = " in source
        return source.replace("const bool aligned = ", "const bool aligned = false && ")

    err, _ = run_paged_kernel("mma", True, 3, dtype="bf16", n_rep=4, head_dim=96, context=200, edit=unaligned)
    assert err < TOLERANCE["bf16"]


# (loop, splits, dtype, head dim, query heads per KV head, RoPE mode (1 base, 2 frequencies), its dims, traditional)
ROPE_CASES = [
    ("mma", 1, "bf16", 128, 4, 1, 128, False),
    ("mma_ahead", 3, "bf16", 64, 8, 2, 64, False),
    ("mma", 3, "bf16", 128, 2, 1, 64, True),  # partial and traditional: the last 64 dims pass unchanged
    ("pipelined", 1, "float", 96, 2, 2, 96, False),
    ("classic", 3, "bf16", 128, 2, 1, 32, False),
]


@pytest.mark.parametrize(("loop", "splits", "dtype", "head_dim", "n_rep", "mode", "dims", "traditional"), ROPE_CASES)
def test_the_kernel_rotates_queries_and_new_keys(loop: str, splits: int, dtype: str, head_dim: int, n_rep: int,
                                                 mode: int, dims: int, traditional: bool) -> None:
    for context, tail, seed in ((200, 3, 0), (2, 1, 1)):
        err, tail_ok = run_paged_kernel(loop, True, splits, dtype=dtype, head_dim=head_dim, n_rep=n_rep, warps=2,
                                        context=context, tail=tail, seed=seed, rope=(mode, dims, traditional))
        assert err < TOLERANCE[dtype], f"context {context}, tail {tail}: error {err:.3g}"
        assert tail_ok, f"context {context}, tail {tail}: the appended tail differs"


def test_a_kernel_that_does_not_rotate_is_caught() -> None:
    # The same inputs without the rotation: the output and the appended key are far from the reference.
    def unrotated(source: str) -> str:
        for line in ("dst[i1] = static_cast<T>(__fmaf_rn(x1, costheta, -__fmul_rn(x2, sintheta)));",
                     "dst[i2] = static_cast<T>(__fmaf_rn(x1, sintheta, __fmul_rn(x2, costheta)));"):
            assert line in source
            source = source.replace(line, "dst[i1] = src[i1]; dst[i2] = src[i2];")
        return source

    err, tail_ok = run_paged_kernel("mma", True, 1, dtype="bf16", head_dim=128, n_rep=4, warps=2, context=200,
                                    tail=3, rope=(1, 128, False), edit=unrotated)
    assert err > TOLERANCE["bf16"] or not tail_ok
    assert not tail_ok


@pytest.mark.parametrize(("loop", "appending", "splits", "dtype", "head_dim", "n_rep", "warps"), [
    ("pipelined", True, 1, "float", 64, 4, 2),
    ("pipelined", True, 3, "float", 64, 2, 2),  # a float32 gpt-oss's split launches
    ("pipelined", False, 3, "bf16", 64, 2, 4),
    ("mma", True, 1, "bf16", 64, 8, 4),  # gpt-oss: 8 query heads of 64 per KV head
    ("mma", True, 5, "bf16", 64, 8, 2),
    ("mma_ahead", True, 4, "bf16", 128, 2, 4),
])
def test_attention_sinks_join_the_softmax(loop: str, appending: bool, splits: int, dtype: str, head_dim: int,
                                          n_rep: int, warps: int) -> None:
    """A sink logit per query head in the denominator only (gpt-oss), merged by the unsplit block
    or split 0; long rows, and rows so short that some splits are empty."""
    for context, tail, seed in ((200, 3, 0), (2, 1, 1)):
        err, tail_exact = run_paged_kernel(loop, appending, splits, dtype=dtype, head_dim=head_dim, n_rep=n_rep,
                                           warps=warps, context=context, tail=tail, seed=seed, sinks=True)
        assert err < TOLERANCE[dtype], f"context {context}, tail {tail}: error {err:.3g}"
        assert tail_exact
