"""Where a long prompt's prefill time goes: each chunk of the runtime's engine against the same
chunk of mlx-lm's own model and KV cache, then the attention of one late chunk by parts.

The runtime's later chunks gather their prefix from the pool and pad the key count
(``prefill_shapes.key_length``: past 16k, to multiples of 4,096, with a front-padding mask);
mlx-lm's KVCache hands SDPA a view of its buffer with a causal mask. This prints, per
chunk start, ms of the runtime's step and of mlx-lm's forward (first run, then a repeat on a
fresh cache), and for one late start: the gather, SDPA causal on exact keys, SDPA with the
padded keys and array mask.

    python3 scripts/long_prefill_cost.py --shape llama-8b --context 32768 --chunk 2048
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

sys.path.insert(0, "tests")
from harness import InProcessService  # noqa: E402

from runtime.bench.models import synthetic_model  # noqa: E402
from runtime.protocol.worker import PrefillChunk, Step  # noqa: E402
from runtime.worker.paths.prefill_shapes import front_padded_mask, key_length  # noqa: E402


def runtime_chunks(engine, tokens: list[int], chunk: int, step0: int) -> list[float]:
    """ms of each chunk's prefill step, one row, slots 1.. in order."""
    times = []
    for i, start in enumerate(range(0, len(tokens), chunk)):
        part = tokens[start : start + chunk]
        c = PrefillChunk(row=0, start=start, token_ids=part, slot_ids=list(range(1 + start, 1 + start + len(part))),
                         prefix_slots=list(range(1, 1 + start)) if start else [])
        t0 = time.perf_counter()
        engine.finalize(engine.launch(Step(step_id=step0 + i, prefills=[c], decode=None)))
        mx.synchronize()
        times.append(1e3 * (time.perf_counter() - t0))
    engine.reset_chain()
    return times


def mlx_chunks(model, tokens: list[int], chunk: int) -> list[float]:
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    times = []
    for start in range(0, len(tokens), chunk):
        x = mx.array(tokens[start : start + chunk])[None]
        t0 = time.perf_counter()
        out = model(x, cache=cache)
        mx.eval(out, [c.state for c in cache])
        times.append(1e3 * (time.perf_counter() - t0))
    return times


def timed(fn, repeats: int = 5) -> float:
    mx.eval(fn())
    t0 = time.perf_counter()
    for _ in range(repeats):
        mx.eval(fn())
    return 1e3 * (time.perf_counter() - t0) / repeats


def attention_parts(start: int, chunk: int, n_q: int, n_kv: int, d: int, context: int) -> None:
    """One layer's attention of a chunk at ``start``, by parts."""
    slots = context + 8
    pool_k = mx.random.normal((slots, n_kv, d)).astype(mx.bfloat16)
    pool_v = mx.random.normal((slots, n_kv, d)).astype(mx.bfloat16)
    q = mx.random.normal((1, n_q, chunk, d)).astype(mx.bfloat16)
    n = start + chunk
    keys = key_length(start, chunk, context)
    index = mx.array(np.arange(1, n + 1, dtype=np.int32)[None])
    padded = mx.array(np.concatenate([np.zeros(keys - n, np.int32), np.arange(1, n + 1, dtype=np.int32)])[None])
    k = pool_k[index].transpose(0, 2, 1, 3)
    v = pool_v[index].transpose(0, 2, 1, 3)
    kc, vc = mx.contiguous(k), mx.contiguous(v)
    kp = mx.contiguous(pool_k[padded].transpose(0, 2, 1, 3))
    vp = mx.contiguous(pool_v[padded].transpose(0, 2, 1, 3))
    mask = front_padded_mask(start, chunk, keys, 4)
    mx.eval(kc, vc, kp, vp, mask)
    scale = d**-0.5
    parts = {
        "gather K/V (transposed view)": lambda: (pool_k[index].transpose(0, 2, 1, 3), pool_v[index].transpose(0, 2, 1, 3)),
        "gather K/V + contiguous": lambda: (mx.contiguous(pool_k[index].transpose(0, 2, 1, 3)),
                                            mx.contiguous(pool_v[index].transpose(0, 2, 1, 3))),
        f"sdpa causal, {n} keys": lambda: mx.fast.scaled_dot_product_attention(q, kc, vc, scale=scale, mask="causal"),
        f"sdpa causal, {n} keys (view)": lambda: mx.fast.scaled_dot_product_attention(q, k, v, scale=scale,
                                                                                       mask="causal"),
        f"sdpa array mask, {keys} keys": lambda: mx.fast.scaled_dot_product_attention(q, kp, vp, scale=scale,
                                                                                       mask=mask),
    }
    for name, fn in parts.items():
        first = time.perf_counter()
        mx.eval(fn())
        first = 1e3 * (time.perf_counter() - first)
        print(f"  start {start}: {name:36s} first {first:7.1f} ms, then {timed(fn):7.2f} ms", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="llama-8b")
    p.add_argument("--context", type=int, default=32768)
    p.add_argument("--chunk", type=int, default=2048)
    p.add_argument("--parts-at", default="16384,18432,30720", help="chunk starts whose attention is timed by parts")
    args = p.parse_args()
    folder = synthetic_model(args.shape, Path(tempfile.gettempdir()) / "runtime-bench")
    cfg = json.loads((folder / "config.json").read_text())
    n_q, n_kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    d = cfg.get("head_dim") or cfg["hidden_size"] // n_q
    print(f"device {mx.default_device()}, {args.shape}, context {args.context}, chunk {args.chunk}", flush=True)
    for start in (int(s) for s in args.parts_at.split(",") if s):
        attention_parts(start, args.chunk, n_q, n_kv, d, args.context)
    mx.clear_cache()
    tokens = np.random.default_rng(0).integers(1, cfg["vocab_size"] - 1, args.context).tolist()
    svc = InProcessService(folder, kv_slots=args.context + 64, max_running=1, max_context=args.context + 32,
                           max_step_tokens=args.chunk, prefill_chunk=args.chunk, fuse=True)
    rt = [runtime_chunks(svc.engine, tokens, args.chunk, 1), runtime_chunks(svc.engine, tokens, args.chunk, 1000)]
    del svc
    mx.clear_cache()
    from mlx_lm import load

    model, _ = load(str(folder))
    ml = [mlx_chunks(model, tokens, args.chunk), mlx_chunks(model, tokens, args.chunk)]
    print("chunk start | runtime ms first / again | mlx-lm ms first / again | again rt/mlx", flush=True)
    for i, start in enumerate(range(0, args.context, args.chunk)):
        print(f"{start:11d} | {rt[0][i]:9.1f} / {rt[1][i]:7.1f} | {ml[0][i]:9.1f} / {ml[1][i]:7.1f} | "
              f"{rt[1][i] / ml[1][i]:.2f}", flush=True)
    print(f"total       | {sum(rt[0]):9.1f} / {sum(rt[1]):7.1f} | {sum(ml[0]):9.1f} / {sum(ml[1]):7.1f} | "
          f"{sum(rt[1]) / sum(ml[1]):.2f}", flush=True)


if __name__ == "__main__":
    main()
