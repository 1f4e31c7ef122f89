"""Our kernels' modules written into MLX's kernel cache (``cubin_kernels``) on a CUDA GPU: MLX
prints the very unit ``mlx_source`` makes, loads the module we wrote instead of building it,
and the launches give the bits of MLX's own build: the paged kernels (single and split
launches, appending, rotating), their combine and the fused add + norm. Each side runs in a
fresh process (MLX reads its cache folder once a process). CUDA only; elsewhere skipped.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from runtime.worker.paths.paged_attention import PagedAttention

pytestmark = pytest.mark.skipif(not PagedAttention.kernel_available(), reason="needs MLX on a CUDA GPU")
ROOT = Path(__file__).resolve().parents[1]

LAUNCHES = r"""
import json, sys
import mlx.core as mx
import numpy as np
from runtime.worker.paths.cuda import cubin_kernels
cubin_kernels.PRECOMPILE = sys.argv[1] == "on"
from runtime.worker.model.kernel_rope import BASE, RopeSpec
from runtime.worker.paths.cuda.add_rms_norm import AddRmsNorm
from runtime.worker.paths.paged_attention import PagedAttention

def batch(rows, n_q, n_kv, d, context, tail, seed):
    rng = np.random.default_rng(seed)
    slots = rows * context + 4
    k = iter(mx.random.split(mx.random.key(seed), 8))
    normal = lambda shape: mx.random.normal(shape, key=next(k)).astype(mx.bfloat16)
    table = np.zeros((rows, context), dtype=np.int32)
    for row in range(rows):
        table[row] = rng.choice(np.arange(1, slots), context, replace=False)
    return (normal((rows, n_q, 1, d)), normal((slots, n_kv, d)), normal((slots, n_kv, d)), mx.array(table),
            mx.arange(rows, dtype=mx.int32), mx.full((rows,), context + tail + 1, dtype=mx.int32),
            normal((rows, n_kv, tail + 2, d)), normal((rows, n_kv, tail + 2, d)), mx.array([tail], dtype=mx.int32),
            normal((rows, n_kv, 1, d)), normal((rows, n_kv, 1, d)))

out = {}
attention = PagedAttention(True)
for launch in [(1, 4), (8, 4)]:
    for rotating in (False, True):
        args = batch(3, 32, 8, 128, 300, 5, seed=launch[0])
        rope = (RopeSpec(BASE, 128, False, 1.0, 500000.0, None), mx.array([7, 300, 4000], dtype=mx.int32)) if rotating else None
        o, k, v = attention.attend_appending(*args, 128**-0.5, launch, rope)
        mx.eval(o, k, v)
        tag = f"{launch[0]}_{rotating}"
        out["out" + tag], out["k" + tag], out["v" + tag] = (np.array(o.astype(mx.float32)),
            np.array(k[:, :, :6].astype(mx.float32)), np.array(v[:, :, :6].astype(mx.float32)))
for width in (2048, 4096):
    k1, k2, k3 = mx.random.split(mx.random.key(width), 3)
    x = mx.random.normal((5, width), key=k1).astype(mx.bfloat16)
    r = mx.random.normal((5, width), key=k2).astype(mx.bfloat16)
    w = (1 + 0.1 * mx.random.normal((width,), key=k3)).astype(mx.bfloat16)
    h, n = AddRmsNorm(True)(x, r, w, 1e-5)
    out[f"h{width}"], out[f"n{width}"] = np.array(h.astype(mx.float32)), np.array(n.astype(mx.float32))
np.savez(sys.argv[2], **out)
store = cubin_kernels.default_store() if cubin_kernels.PRECOMPILE else None
print(json.dumps(None if store is None else {"built": store.built, "found": store.found, "failed": store.failed,
                                             "mismatch": store.mismatch}))
"""


def _run(mode: str, cache: Path, result: Path) -> subprocess.CompletedProcess:
    path = os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])
    env = dict(os.environ, MLX_PTX_CACHE_DIR=str(cache), PYTHONPATH=path)
    return subprocess.run([sys.executable, "-c", LAUNCHES, mode, str(result)], env=env, capture_output=True,
                          text=True, timeout=600)


def test_mlx_loads_our_modules_and_they_give_its_own_builds_bits(tmp_path):
    mlx_built = _run("off", tmp_path / "mlx-cache", tmp_path / "mlx.npz")
    assert mlx_built.returncode == 0, mlx_built.stderr[-3000:]
    first = _run("on", tmp_path / "our-cache", tmp_path / "first.npz")
    assert first.returncode == 0, first.stderr[-3000:]
    counts = json.loads(first.stdout.strip().splitlines()[-1])
    assert counts["mismatch"] is None and counts["failed"] == 0 and counts["built"] >= 5, counts
    restart = _run("on", tmp_path / "our-cache", tmp_path / "restart.npz")
    assert restart.returncode == 0, restart.stderr[-3000:]
    again = json.loads(restart.stdout.strip().splitlines()[-1])
    assert again["built"] == 0 and again["found"] == counts["built"], again
    want = np.load(tmp_path / "mlx.npz")
    for name in ("first", "restart"):
        got = np.load(tmp_path / f"{name}.npz")
        for key in want.files:
            assert np.array_equal(got[key], want[key]), f"{name}: {key}"
    # MLX really reads the modules: names that lead nowhere make its launch fail
    for names in (tmp_path / "our-cache").rglob("*.txt"):
        names.write_text("".join(line.split("\t")[0] + "\tno_such_kernel\n" for line in names.read_text().splitlines()))
    broken = _run("on", tmp_path / "our-cache", tmp_path / "broken.npz")
    assert broken.returncode != 0, broken.stdout[-500:]
