"""Where the paged kernel's RoPE (``kernel_rope``) and ``mx.fast.rope`` part, on a CUDA GPU.

For each spec (base, scale, dims, traditional, frequencies) and row count, the appending
kernel rotates new keys at spread positions; its appended keys are compared with
``mx.fast.rope``'s bit for bit, and the first differences are printed (position, dim,
both values), with ``check_kernel_rope``'s verdict.

    python3 scripts/rope_bits.py
"""

from __future__ import annotations

import sys
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.worker.model.kernel_rope import BASE, FREQS, RopeSpec  # noqa: E402
from runtime.worker.paths.cuda.kernel_check import check_kernel_rope  # noqa: E402
from runtime.worker.paths.paged_attention import PagedAttention  # noqa: E402

N_KV, N_REP, D = 8, 4, 128


def specs() -> dict[str, RopeSpec]:
    from mlx_lm.models.rope_utils import Llama3RoPE

    llama3 = Llama3RoPE(D, 131072, False, 500000.0, scaling_config={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192})
    freqs = mx.contiguous(llama3._freqs.astype(mx.float32))
    return {
        "base 500000": RopeSpec(BASE, D, False, 1.0, 500000.0, None),
        "base 10000": RopeSpec(BASE, D, False, 1.0, 10000.0, None),
        "base 1000000": RopeSpec(BASE, D, False, 1.0, 1000000.0, None),
        "base 10000 scale 0.25": RopeSpec(BASE, D, False, 0.25, 10000.0, None),
        "base 500000 scale 0.25": RopeSpec(BASE, D, False, 0.25, 500000.0, None),
        "base 10000 scale 0.5": RopeSpec(BASE, D, False, 0.5, 10000.0, None),
        "partial traditional": RopeSpec(BASE, 64, True, 1.0, 10000.0, None),
        "llama3 freqs": RopeSpec(FREQS, D, False, 1.0, None, freqs),
    }


def compare(attention: PagedAttention, spec: RopeSpec, rows: int, top: int) -> str:
    positions = mx.array(np.linspace(0, top - 1, rows).astype(np.int32)) if rows > 1 else mx.array([top // 3])
    k = mx.random.normal((rows, N_KV, 1, D), key=mx.random.key(3)).astype(mx.bfloat16)
    q = mx.random.normal((rows, N_KV * N_REP, 1, D), key=mx.random.key(4)).astype(mx.bfloat16)
    pool = mx.zeros((2, N_KV, D), dtype=mx.bfloat16)
    table = mx.ones((rows, 1), dtype=mx.int32)
    tail = mx.zeros((rows, N_KV, 2, D), dtype=mx.bfloat16)
    _, keys, _ = attention.attend_appending(q, pool, pool, table, mx.arange(rows, dtype=mx.int32),
                                            mx.full((rows,), 2, dtype=mx.int32), tail, tail,
                                            mx.array([0], dtype=mx.int32), k, k, 0.1, (1, 4), (spec, positions))
    expected = spec.rotate(k, positions)
    got = np.array(keys[:, :, 0].astype(mx.float32))
    want = np.array(expected[:, :, 0].astype(mx.float32))
    bad = np.argwhere(got != want)
    if not len(bad):
        return "keys equal"
    p = np.array(positions)
    rows_bad = sorted({int(b[0]) for b in bad})
    sample = [f"pos {p[b[0]]} dim {b[2]}: {got[tuple(b)]:.6g} vs {want[tuple(b)]:.6g}" for b in bad[:4]]
    return f"{len(bad)} of {got.size} key elements differ (rows {rows_bad[:8]}): " + "; ".join(sample)


def main() -> int:
    attention = PagedAttention(True, loop="mma")
    for name, spec in specs().items():
        for rows in (1, 16):
            for top in (4096, 131072):
                print(f"{name:24s} rows {rows:2d} up to {top:6d}: {compare(attention, spec, rows, top)}", flush=True)
        verdict = check_kernel_rope(attention, mx.bfloat16, N_KV, N_REP, D, (spec,), [(1, 4)], 131072)
        print(f"{name:24s} check_kernel_rope: {verdict or 'passes'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
