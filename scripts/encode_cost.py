"""The host time MLX spends per primitive, by kind: building it in Python and submitting it.

A one-row decode step is host-bound: its time is the Python that builds the graph and MLX's
submit (on a GPU, encoding each kernel). ``graph_diff.py`` counts a step's primitives by kind,
ours against mlx-lm's; ours has fewer, yet took longer to submit (session 39: Qwen3-Next widths
and latent attention at one row). This times each kind on its own, so the counts can be weighed:
``count x submit us`` per kind. Each kind builds ``--count`` primitives on small arrays (the
device work is negligible), ``mx.async_eval`` submits them, then the run waits; the first of
``--repeats`` rounds builds kernels and is reported on its own.

    python scripts/encode_cost.py                  # every kind this device runs
    python scripts/encode_cost.py --kinds add,custom,scatter,slice_update --count 400
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import mlx.core as mx
import numpy as np

ROWS, WIDTH = 8, 256


def _custom_kernel() -> Callable[[mx.array], mx.array] | None:
    """A one-line copy kernel through ``mx.fast``'s custom kernel of this device, or None."""
    source = "uint i = thread_position_in_grid.x; out[i] = inp[i];"
    if mx.default_device() == mx.gpu and mx.metal.is_available():
        kernel = mx.fast.metal_kernel(name="encode_cost_copy", input_names=["inp"], output_names=["out"], source=source)
    elif mx.default_device() == mx.gpu and hasattr(mx.fast, "cuda_kernel"):
        kernel = mx.fast.cuda_kernel(
            name="encode_cost_copy", input_names=["inp"], output_names=["out"],
            source="auto i = blockIdx.x * blockDim.x + threadIdx.x; out[i] = inp[i];")
    else:
        return None

    def run(x: mx.array) -> mx.array:
        return kernel(inputs=[x], grid=(x.size, 1, 1), threadgroup=(min(x.size, 256), 1, 1),
                      output_shapes=[x.shape], output_dtypes=[x.dtype])[0]
    return run


def kinds() -> dict[str, Callable[[int], list[mx.array]]]:
    """Each kind: a builder of ``n`` primitives of it (lazy), on arrays made and evaluated here."""
    dtype = mx.bfloat16
    a = mx.random.normal((ROWS, WIDTH)).astype(dtype)
    b = mx.random.normal((ROWS, WIDTH)).astype(dtype)
    w = mx.random.normal((WIDTH, WIDTH)).astype(dtype)
    norm = mx.ones((WIDTH,), dtype=dtype)
    pool = mx.zeros((1024, WIDTH), dtype=dtype)
    heads = mx.random.normal((1, 4, ROWS, 64)).astype(dtype)
    idx = mx.array([3, 5], dtype=mx.int32)
    mx.eval(a, b, w, norm, pool, heads, idx)
    fused = mx.compile(lambda x, y: mx.sigmoid(x) * y + x)
    custom = _custom_kernel()

    def chain(n: int, step: Callable[[mx.array, int], mx.array]) -> list[mx.array]:
        x = mx.array(pool)  # its own buffer: each update's input is the last one's output (donated)
        for i in range(n):
            x = step(x, i)
        return [x]

    def scatter(x: mx.array, i: int) -> mx.array:
        x[idx + i % 512] = a[:2]
        return x

    out: dict[str, Callable[[int], list[mx.array]]] = {
        "add": lambda n: [a + i for i in range(n)],
        "slice (no kernel)": lambda n: [a[i % ROWS : i % ROWS + 1] for i in range(n)],
        "reshape (no kernel)": lambda n: [a.reshape(ROWS * 2, WIDTH // 2) for _ in range(n)],
        "contiguous copy": lambda n: [mx.contiguous(a.T) for _ in range(n)],
        "astype": lambda n: [(a + i).astype(mx.float32) for i in range(n)],
        "take (gather)": lambda n: [pool[idx + i] for i in range(n)],
        "scatter (chained)": lambda n: chain(n, scatter),
        "slice_update (chained)": lambda n: chain(n, lambda x, i: mx.slice_update(
            x, a[:1], mx.array([i % 1024], dtype=mx.int32), axes=(0,))),
        "concatenate": lambda n: [mx.concatenate([a, b]) for _ in range(n)],
        "matmul": lambda n: [a @ w for _ in range(n)],
        "rms_norm": lambda n: [mx.fast.rms_norm(a, norm, 1e-6) for _ in range(n)],
        "rope": lambda n: [mx.fast.rope(heads, 64, traditional=False, base=10000.0, scale=1.0, offset=i)
                           for i in range(n)],
        "sdpa": lambda n: [mx.fast.scaled_dot_product_attention(heads, heads, heads, scale=0.125) for _ in range(n)],
        "compiled (3 ops fused)": lambda n: [fused(a, b) for _ in range(n)],
        "host array -> device": lambda n: [mx.array(np.full((ROWS,), i, dtype=np.int32)) + 1 for i in range(n)],
    }
    if custom is not None:
        out["custom kernel"] = lambda n: [custom(a + 0) for _ in range(n)]
    return out


def time_kind(build: Callable[[int], list[mx.array]], count: int, repeats: int) -> dict[str, float]:
    """Per primitive, in us: build and submit (median of the rounds after the first), and the
    first round's submit (kernel builds included)."""
    rounds = []
    for _ in range(repeats):
        mx.synchronize()
        t0 = time.perf_counter()
        outs = build(count)
        t1 = time.perf_counter()
        mx.async_eval(outs)
        t2 = time.perf_counter()
        mx.eval(outs)
        rounds.append((t1 - t0, t2 - t1))
    later = rounds[1:] or rounds
    per = 1e6 / count
    return {"build": per * statistics.median(r[0] for r in later),
            "submit": per * statistics.median(r[1] for r in later),
            "first_submit": per * rounds[0][1]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--count", type=int, default=200, help="primitives of a kind per round")
    p.add_argument("--repeats", type=int, default=6)
    p.add_argument("--kinds", default="", help="comma-separated names (prefixes) to run; default all")
    args = p.parse_args()
    table = kinds()
    wanted = [k for k in table if not args.kinds or any(k.startswith(w) for w in args.kinds.split(","))]
    print(f"device {mx.default_device()}, {args.count} primitives a round, {args.repeats} rounds (the first "
          "builds kernels)")
    print(f"{'kind':28s} {'build us':>9s} {'submit us':>10s} {'first submit us':>16s}")
    for name in wanted:
        t = time_kind(table[name], args.count, args.repeats)
        print(f"{name:28s} {t['build']:9.2f} {t['submit']:10.2f} {t['first_submit']:16.2f}")


if __name__ == "__main__":
    main()
