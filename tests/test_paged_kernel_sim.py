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


def test_a_wrong_softmax_is_caught() -> None:
    def unshifted(source: str) -> str:
        assert "expf(s[u] - mn)" in source
        return source.replace("expf(s[u] - mn)", "expf(s[u])")

    err, _ = run_paged_kernel("pipelined", False, 1, context=200, edit=unshifted)
    assert err > 100 * TOLERANCE["float"]



def test_a_wrong_mma_fragment_is_caught() -> None:
    def swapped(source: str) -> str:
        old = "mma16816(oacc[nt + 1], pa, vb + 2, (const T*)nullptr);"
        assert old in source  # the second n-tile's product with the first one's V fragments
        return source.replace(old, "mma16816(oacc[nt + 1], pa, vb, (const T*)nullptr);")

    err, _ = run_paged_kernel("mma", False, 1, dtype="bf16", n_rep=4, context=200, edit=swapped)
    assert err > 10 * TOLERANCE["bf16"]  # values of the wrong positions: far off (about 1.3)
