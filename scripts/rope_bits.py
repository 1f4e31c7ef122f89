"""Where the paged kernel's RoPE (``kernel_rope``) and ``mx.fast.rope`` part, on a CUDA GPU.

For each spec (base, scale, dims, traditional, frequencies), the appending kernel rotates new
keys of one row at 16 random positions and of 64 rows; its appended keys are compared with ``mx.fast.rope``'s bit for bit,
and the count of differing elements is printed with a sample, then ``check_kernel_rope``'s
verdict. (Session 27 ran it with four roundings of the rotation side by side:
docs/runs/h100-s27-w4-rope-bits-forms.log; the kernel keeps the one that matched.)

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


def mismatches(attention: PagedAttention, spec: RopeSpec, positions: np.ndarray, seed: int) -> tuple[int, int, str]:
    """Key elements the rotating kernel's appended keys differ in from ``mx.fast.rope``'s, of how many."""
    rows = len(positions)
    pos = mx.array(positions.astype(np.int32))
    k = mx.random.normal((rows, N_KV, 1, D), key=mx.random.key(seed)).astype(mx.bfloat16)
    q = mx.random.normal((rows, N_KV * N_REP, 1, D), key=mx.random.key(seed + 1)).astype(mx.bfloat16)
    pool = mx.zeros((2, N_KV, D), dtype=mx.bfloat16)
    table = mx.ones((rows, 1), dtype=mx.int32)
    tail = mx.zeros((rows, N_KV, 2, D), dtype=mx.bfloat16)
    _, keys, _ = attention.attend_appending(q, pool, pool, table, mx.arange(rows, dtype=mx.int32),
                                            mx.full((rows,), 2, dtype=mx.int32), tail, tail,
                                            mx.array([0], dtype=mx.int32), k, k, 0.1, (1, 4), (spec, pos))
    got = np.array(keys[:, :, 0].astype(mx.float32))
    want = np.array(spec.rotate(k, pos)[:, :, 0].astype(mx.float32))
    bad = np.argwhere(got != want)
    sample = "; ".join(f"pos {positions[b[0]]} dim {b[2]}: {got[tuple(b)]:.6g} vs {want[tuple(b)]:.6g}" for b in bad[:2])
    return len(bad), got.size, sample


def main() -> int:
    attention = PagedAttention(True, loop="mma")
    rng = np.random.default_rng(0)
    for name, spec in specs().items():
        single = [mismatches(attention, spec, rng.integers(0, 131072, 1), s) for s in range(16)]
        batch = mismatches(attention, spec, np.sort(rng.integers(0, 131072, 64)), 99)
        n1, t1 = sum(m[0] for m in single), sum(m[1] for m in single)
        sample = next((m[2] for m in single + [batch] if m[0]), "")
        print(f"{name:24s} one row {n1} of {t1} differ, 64 rows {batch[0]} of {batch[1]} {sample}", flush=True)
        verdict = check_kernel_rope(attention, mx.bfloat16, N_KV, N_REP, D, (spec,), [(1, 4)], 131072)
        print(f"{name:24s} check_kernel_rope: {verdict or 'passes'}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
