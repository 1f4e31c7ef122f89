"""Our kernels launched as CUBINs from the store (``cubin_kernels``) give the bits MLX's own
build of the same source gives: the paged kernels (single and split launches, appending,
rotating), their combine and the fused add + norm. CUDA only (``PRECOMPILE`` is switched on
here, the worker's default stays as the module says); elsewhere reported as skipped.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from runtime.worker.model.kernel_rope import BASE, RopeSpec
from runtime.worker.paths.cuda import cubin_kernels
from runtime.worker.paths.cuda.add_rms_norm import AddRmsNorm
from runtime.worker.paths.paged_attention import PagedAttention

pytestmark = pytest.mark.skipif(not PagedAttention.kernel_available(), reason="needs MLX on a CUDA GPU")


def _batch(rows: int, n_q: int, n_kv: int, d: int, context: int, tail: int, seed: int):
    rng = np.random.default_rng(seed)
    slots = rows * context + 4
    k = iter(mx.random.split(mx.random.key(seed), 8))
    normal = lambda shape: mx.random.normal(shape, key=next(k)).astype(mx.bfloat16)  # noqa: E731
    table = np.zeros((rows, context), dtype=np.int32)
    for row in range(rows):
        table[row] = rng.choice(np.arange(1, slots), context, replace=False)
    pool = (normal((rows, n_q, 1, d)), normal((slots, n_kv, d)), normal((slots, n_kv, d)), mx.array(table),
            mx.arange(rows, dtype=mx.int32), mx.full((rows,), context + tail + 1, dtype=mx.int32))
    step = (normal((rows, n_kv, tail + 2, d)), normal((rows, n_kv, tail + 2, d)), mx.array([tail], dtype=mx.int32),
            normal((rows, n_kv, 1, d)), normal((rows, n_kv, 1, d)))
    return pool, step


def _attend(precompile: bool, monkeypatch, args, launch, rope):
    monkeypatch.setattr(cubin_kernels, "PRECOMPILE", precompile)
    attention = PagedAttention(True)
    out = attention.attend_appending(*args, 128**-0.5, launch, rope)
    mx.eval(*out)
    kinds = {type(k) for k in attention._kernels.values()}
    return out, kinds


@pytest.mark.parametrize("launch", [(1, 4), (8, 4)])
@pytest.mark.parametrize("rotating", [False, True])
def test_the_paged_kernels_as_cubins_give_mlx_builds_bits(monkeypatch, launch, rotating):
    pool, step = _batch(3, 32, 8, 128, 300, 5, seed=launch[0])
    rope = (RopeSpec(BASE, 128, False, 1.0, 500000.0, None), mx.array([7, 300, 4000], dtype=mx.int32)) if rotating else None
    args = (*pool, *step)
    want, mlx_kinds = _attend(False, monkeypatch, args, launch, rope)
    got, cubin_kinds = _attend(True, monkeypatch, args, launch, rope)
    assert cubin_kinds == {cubin_kernels.CubinKernel} and cubin_kinds != mlx_kinds
    for name, a, b in zip(("output", "tail keys", "tail values"), got, want):
        assert mx.array_equal(a, b).item(), name
    store = cubin_kernels.default_store()
    assert store is not None and store.built + store.read > 0


@pytest.mark.parametrize("width", [2048, 4096])
def test_the_fused_norm_as_a_cubin_gives_mlx_builds_bits(monkeypatch, width):
    k1, k2, k3 = mx.random.split(mx.random.key(width), 3)
    x = mx.random.normal((5, width), key=k1).astype(mx.bfloat16)
    r = mx.random.normal((5, width), key=k2).astype(mx.bfloat16)
    w = (1 + 0.1 * mx.random.normal((width,), key=k3)).astype(mx.bfloat16)
    outs = []
    for precompile in (False, True):
        monkeypatch.setattr(cubin_kernels, "PRECOMPILE", precompile)
        norm = AddRmsNorm(True)
        outs.append(norm(x, r, w, 1e-5))
        mx.eval(*outs[-1])
        assert isinstance(norm._kernel, cubin_kernels.CubinKernel) == precompile
        assert norm.check(width, mx.bfloat16) is None
    for a, b in zip(*outs):
        assert mx.array_equal(a, b).item()
