"""Time one decode step of the worker's Engine against mlx-lm's KVCache path, phase by phase.

No service, no sockets: an in-process random-weight model of a synthetic bench shape,
``batch`` rows prefilled to ``--context`` tokens, then ``--steps`` chained decode steps.
Prints ms per step and where the host time goes (graph build, async_eval, wait). Every
engine mode runs the worker's warm-up first (``--cold-engine``: not, as before session 8).

    python scripts/profile_decode.py --shape llama-1b --batch 1,64,256
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import os
import time

import kernel_trace
import mlx.core as mx
import numpy as np
from runtime.worker.paths.rows.parallel_attention import default_streams

MAX_ROWS = int(os.environ.get("PROFILE_MAX_ROWS", "0"))  # engine rows beyond the batch (a service's max_running)


def make_model(shape: str, overrides: dict | None = None):
    """The shape's own architecture (Gemma 3, gpt-oss, Llama), random weights, in its dtype;
    ``overrides``: config keys set on top of the shape's (``--set``)."""
    import importlib

    from runtime.bench.models import shape_config

    cfg = {**shape_config(shape), **(overrides or {})}
    arch = importlib.import_module(f"mlx_lm.models.{cfg['model_type']}")
    model = arch.Model(arch.ModelArgs.from_dict(cfg))
    dtype = {"bfloat16": mx.bfloat16, "float32": mx.float32}[cfg["torch_dtype"]]
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    return model, cfg


def time_mlx(model, batch: int, context: int, steps: int, around=contextlib.nullcontext) -> dict:
    """mlx-lm's path: one KVCache per layer over the batch, generate_step-style pipelining."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    prompt = mx.random.randint(0, 1000, (batch, context))
    mx.eval(model(prompt, cache=cache))

    def step(y):
        logits = model(y[:, None], cache=cache)[:, -1, :]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        return mx.argmax(logprobs, axis=-1)

    y = mx.zeros((batch,), dtype=mx.int32)
    y = step(y)
    mx.async_eval(y)
    with around():
        return _mlx_loop(step, y, steps)


def _mlx_loop(step, y, steps: int) -> dict:
    build = submit = wait = 0.0
    per_step = []
    start = time.perf_counter()
    for _ in range(steps):
        t0 = time.perf_counter()
        nxt = step(y)
        t1 = time.perf_counter()
        mx.async_eval(nxt)
        t2 = time.perf_counter()
        y.tolist()
        t3 = time.perf_counter()
        build, submit, wait = build + t1 - t0, submit + t2 - t1, wait + t3 - t2
        per_step.append(t3 - t0)
        y = nxt
    total = time.perf_counter() - start
    times = np.array(per_step) * 1e3
    return {"ms": 1e3 * total / steps, "build": 1e3 * build / steps, "submit": 1e3 * submit / steps,
            "wait": 1e3 * wait / steps,
            "extra": f"  step p50 {np.percentile(times, 50):.2f} p95 {np.percentile(times, 95):.2f} max {times.max():.2f}"}


def time_engine(model, batch: int, context: int, steps: int, overlap: bool, slots_total: int, stagger: int = 0,
                warm: bool = False, around=contextlib.nullcontext, row_cache: bool | None = None,
                attention_streams: int = 1, compile_decode: bool = True, aux_slots: int = 0) -> dict:
    """The worker's Engine: prefill every row, then chained decode steps in the worker's order.
    A hybrid model's rows take aux-state slots 1..batch of a pool of ``aux_slots`` (0: the
    worker's default for these rows, 8 a row)."""
    from runtime.protocol.worker import AUX_FRESH, DecodeBatch, PrefillChunk, Step
    from runtime.worker.decode_warmup import warm_decode
    from runtime.worker.engine import Engine
    from runtime.worker.model.discovery import discover
    from runtime.worker.pools.aux_pool import AuxPool
    from runtime.worker.pools.kv_pool import KVPool

    layout = discover(model)
    seq = context + stagger + steps + 8
    num_slots = max(slots_total, batch * seq + 1)
    pool = KVPool(len(layout.attention_layers), num_slots, layout.kv_shapes, layout.kv_dtype)
    rows = max(batch, MAX_ROWS)
    aux_pool = None
    if layout.has_aux:
        aux_pool = AuxPool.allocate(AuxPool.probe(model, layout), max(aux_slots or 8 * rows + 1, batch + 1),
                                    row_writes=mx.default_device().type == mx.DeviceType.cpu)  # as the loader
    engine = Engine(model, layout, pool, rows, seq, aux_pool, row_cache=row_cache,
                    attention_streams=attention_streams, compile_decode=compile_decode)
    aux = (lambda r: {"aux_slot": 1 + r, "aux_source": AUX_FRESH}) if aux_pool is not None else (lambda r: {})
    if warm:
        warm_decode(engine)  # what the worker does before it takes requests
    rng = np.random.default_rng(0)
    step_id = 0
    # ``stagger``: row r is r * stagger // batch tokens longer, so the batch is never in lockstep
    # (1: odd rows one token longer; the size of a context: rows spread as in real traffic).
    extra = [int(r % 2) if stagger == 1 else r * stagger // batch for r in range(batch)]
    for r in range(batch):
        n = context + extra[r]
        chunk = PrefillChunk(row=r, start=0, token_ids=rng.integers(0, 1000, n).tolist(),
                             slot_ids=list(range(1 + r * seq, 1 + r * seq + n)), **aux(r))
        engine.finalize(engine.launch(Step(step_id=step_id, prefills=[chunk], decode=None)))
        step_id += 1

    def decode_step(pos: int, first: bool) -> Step:
        nonlocal step_id
        step_id += 1
        return Step(step_id=step_id, prefills=[], decode=DecodeBatch(
            rows=list(range(batch)), token_ids=[1] * batch if first else [-1] * batch,
            positions=[pos + extra[r] for r in range(batch)],
            slot_ids=[1 + r * seq + pos + extra[r] for r in range(batch)],
            temperatures=[0.0] * batch, aux_slots=[1 + r for r in range(batch)] if aux_pool is not None else []))

    with around():
        pending = engine.launch(decode_step(context, True))
        build = submit = wait = 0.0
        per_step: list[tuple[float, bool]] = []  # (seconds, in place) per loop iteration
        start = time.perf_counter()
        for i in range(steps):
            t0 = time.perf_counter()
            built = engine.build(decode_step(context + 1 + i, False))
            t1 = time.perf_counter()
            if overlap:
                engine.submit(built)
                t2 = time.perf_counter()
                engine.finalize(pending)
                t3 = time.perf_counter()
                submit, wait = submit + t2 - t1, wait + t3 - t2
            elif not built.in_place:  # what the worker does with a step that feeds the decode tail
                engine.submit(built)
                t2 = time.perf_counter()
                engine.finalize(pending)
                t3 = time.perf_counter()
                submit, wait = submit + t2 - t1, wait + t3 - t2
            else:
                engine.finalize(pending)
                t2 = time.perf_counter()
                engine.submit(built)
                t3 = time.perf_counter()
                wait, submit = wait + t2 - t1, submit + t3 - t2
            build += t1 - t0
            per_step.append((time.perf_counter() - t0, built.in_place))
            pending = built
        engine.finalize(pending)
        total = time.perf_counter() - start
    times = np.array([t for t, _ in per_step]) * 1e3
    flush = [t * 1e3 for t, in_place in per_step if in_place]
    extra = (f"  step p50 {np.percentile(times, 50):.2f} p95 {np.percentile(times, 95):.2f} max {times.max():.2f}"
             f"  in-place steps {len(flush)} mean {np.mean(flush) if flush else 0:.2f}")
    return {"ms": 1e3 * total / steps, "build": 1e3 * build / steps, "submit": 1e3 * submit / steps,
            "wait": 1e3 * wait / steps, "extra": extra}


def check_kernel() -> None:
    """The paged decode kernel against the gather + masked SDPA fallback on random data."""
    from runtime.worker.model.discovery import AttentionShape
    from runtime.worker.paths.cuda.kernel_launch import launch_shape, splits_for
    from runtime.worker.paths.paged_attention import PagedAttention
    from runtime.worker.pools.kv_pool import KVPool

    rng = np.random.default_rng(0)
    for (n_q, n_kv, d), b in itertools.product(((32, 8, 64), (32, 8, 128), (16, 2, 128), (8, 8, 64), (16, 4, 96)), (5, 1)):
        pool = KVPool(1, 4000, AttentionShape(n_q, n_kv, d), mx.bfloat16)
        pool.keys[0] = mx.random.normal(pool.keys[0].shape).astype(mx.bfloat16)
        pool.values[0] = mx.random.normal(pool.values[0].shape).astype(mx.bfloat16)
        t = 384
        lengths = rng.integers(1, t + 1, b)
        table = rng.integers(1, 4000, (b, t)).astype(np.int32)
        table[np.arange(t)[None, :] >= lengths[:, None]] = 0
        q = mx.random.normal((b, n_q, 1, d)).astype(mx.bfloat16)
        full = np.zeros((b + 3, t), dtype=np.int32)
        order = rng.permutation(b + 3)[:b]
        full[order] = table
        tail = 3  # the last 3 positions of each row come from the decode tail
        tail_k = mx.random.normal((b, n_kv, tail, d)).astype(mx.bfloat16)
        tail_v = mx.random.normal((b, n_kv, tail, d)).astype(mx.bfloat16)
        keys = mx.concatenate([pool.keys[0][mx.array(table)].transpose(0, 2, 1, 3), tail_k], axis=2)
        values = mx.concatenate([pool.values[0][mx.array(table)].transpose(0, 2, 1, 3), tail_v], axis=2)
        valid = np.concatenate([np.arange(t)[None, :] < lengths[:, None], np.ones((b, tail), dtype=bool)], axis=1)
        ref = mx.fast.scaled_dot_product_attention(q, keys, values, scale=d**-0.5, mask=mx.array(valid)[:, None, None, :])
        for max_length in (0, t + tail):
            out = PagedAttention(True)._kernel_attend(
                q, pool.keys[0], pool.values[0], mx.array(full), mx.array(order.astype(np.int32)),
                mx.array((lengths + tail).astype(np.int32)), tail_k, tail_v, mx.array([tail], dtype=mx.int32), d**-0.5,
                launch_shape(b, n_kv, n_q // n_kv, d, max_length))
            err = mx.abs(out.astype(mx.float32) - ref.astype(mx.float32)).max().item()
            splits = splits_for(b * n_kv, max_length)
            print(f"kernel check heads {n_q}/{n_kv} dim {d} rows {b} splits {splits}: max abs diff {err:.5f}", flush=True)


def time_kernel(batches: list[int], context: int, calls: int = 64) -> None:
    """The paged kernel alone (one split vs the chosen splits) against MLX's fused SDPA on
    contiguous K/V, at the 8B shape (32/8 heads, dim 128), ``calls`` layers chained per eval."""
    from paged_kernel_ab import chained_us

    from runtime.worker.model.discovery import AttentionShape
    from runtime.worker.paths.cuda.kernel_launch import launch_shape, splits_for
    from runtime.worker.paths.paged_attention import PagedAttention
    from runtime.worker.pools.kv_pool import KVPool

    n_q, n_kv, d = 32, 8, 128
    for b in batches:
        pool = KVPool(1, b * context + 8, AttentionShape(n_q, n_kv, d), mx.bfloat16)
        pool.keys[0] = mx.random.normal(pool.keys[0].shape).astype(mx.bfloat16)
        pool.values[0] = mx.random.normal(pool.values[0].shape).astype(mx.bfloat16)
        table = mx.array((1 + np.arange(b * context)).reshape(b, context).astype(np.int32))
        rows = mx.arange(b, dtype=mx.int32)
        lengths = mx.full((b,), context, dtype=mx.int32)
        tail_k = mx.zeros((b, n_kv, 0, d), dtype=mx.bfloat16)
        q = mx.random.normal((b, n_q, 1, d)).astype(mx.bfloat16)
        k = mx.random.normal((b, n_kv, context, d)).astype(mx.bfloat16)
        v = mx.random.normal((b, n_kv, context, d)).astype(mx.bfloat16)
        attn = PagedAttention(True)  # the worker's loops
        tail_len = mx.array([tail_k.shape[2]], dtype=mx.int32)
        runs = {
            "kernel 1 split": lambda x: attn._kernel_attend(x, pool.keys[0], pool.values[0], table, rows, lengths,
                                                            tail_k, tail_k, tail_len, d**-0.5),
            f"kernel {splits_for(b * n_kv, context)} splits": lambda x: attn._kernel_attend(
                x, pool.keys[0], pool.values[0], table, rows, lengths, tail_k, tail_k, tail_len, d**-0.5,
                launch_shape(b, n_kv, n_q // n_kv, d, context)),
            "mx.fast sdpa": lambda x: mx.fast.scaled_dot_product_attention(x, k, v, scale=d**-0.5),
        }
        for name, fn in runs.items():
            us = chained_us(fn, q, calls)
            print(f"attention B={b:4d} context {context}: {name:16s} {us:7.1f} us/call", flush=True)


def no_split(fn):
    """Run ``fn`` with the paged kernel's position splitting turned off."""
    from runtime.worker.paths.cuda import kernel_launch

    saved = kernel_launch.MAX_SPLITS
    kernel_launch.MAX_SPLITS = 1
    try:
        return fn()
    finally:
        kernel_launch.MAX_SPLITS = saved


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--batch", default="1,16")
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--modes", default="mlx,engine,engine-overlap",
                   help="comma-separated (mlx, engine, engine-overlap, engine-stagger, engine-spread: rows 0..context positions apart, ...); a mode ending in -fused runs with fused projections (and so do all after it)")
    p.add_argument("--big-pool", type=int, default=0, help="engine pool slots at least this many")
    p.add_argument("--aux-slots", type=int, default=0,
                   help="engine modes, hybrid models: aux-state pool slots (0: the worker's default, 8 a row + 1)")
    p.add_argument("--row-cache", choices=("auto", "on", "off"), default="auto",
                   help="engine modes: the worker's choice, or force the row cache on / off (off: the pool gather)")
    p.add_argument("--eager", action="store_true", help="engine modes: worker.compile_decode off")
    p.add_argument("--attention-threads", type=int, default=0,
                   help="engine modes: worker.attention_threads (0, the default: as the worker picks)")
    p.add_argument("--cold-engine", action="store_true",
                   help="engine modes skip the worker's warm-up, so the compiled step's traces compile inside the "
                        "timed run (what runs before session 8 measured)")
    p.add_argument("--check", action="store_true", help="check the paged kernel first (CUDA)")
    p.add_argument("--kernels", action="store_true", help="trace each mode's kernels with torch.profiler (CUDA)")
    p.add_argument("--kernel", default="", help="time the attention kernel alone at these batch sizes (CUDA)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON",
                   help="a config key of the shape set to a JSON value, e.g. full_attention_interval=1 (every "
                        "Qwen3-Next layer attention) or =1000 (none): which layers' kernels a step has")
    args = p.parse_args()
    overrides = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    if args.check:
        check_kernel()
    if args.kernel:
        time_kernel([int(b) for b in args.kernel.split(",")], args.context)
    if not args.modes:
        return
    model, cfg = make_model(args.shape, overrides)
    nullctx = contextlib.nullcontext
    residuals_fused = False
    print(f"device {mx.default_device()}, shape {args.shape}{f' {overrides}' if overrides else ''}, "
          f"context {args.context}, steps {args.steps}")
    for batch in [int(b) for b in args.batch.split(",")]:
        for label in args.modes.split(","):
            mode = label
            if mode.endswith("-fused"):  # fuses the model in place from here on: list these modes last
                from runtime.worker.model.fused_projections import (
                    fuse_projections,
                    probe_rows,
                    stacked_line,
                )
                from runtime.worker.model.fused_residual import fuse_residuals
                from runtime.worker.paths.cuda.add_rms_norm import AddRmsNorm

                if fuse_projections(model):  # as the worker's loader does: probe the row counts used
                    print(stacked_line(probe_rows(model, sorted({1, batch}))), flush=True)
                if not residuals_fused:  # once: its residual adds too, as the loader does
                    add_norm = AddRmsNorm(mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available())
                    blocks = fuse_residuals(model, add_norm, cfg["vocab_size"])
                    kernel = "one kernel" if add_norm.use_kernel else add_norm.problem or "MLX's kernels"
                    print(f"{blocks} blocks add their residuals and RMS-normalize together ({kernel})", flush=True)
                    residuals_fused = True
                mode = mode.removesuffix("-fused")
            warm_up = not args.cold_engine  # every engine mode warms up first (as the worker does) unless asked

            row_cache = {"auto": None, "on": True, "off": False}[args.row_cache]
            streams = args.attention_threads or default_streams(os.cpu_count())

            def engine(overlap=False, stagger=0, warm=warm_up, a=nullctx):
                return time_engine(model, batch, args.context, args.steps, overlap, args.big_pool, stagger, warm=warm,
                                   around=a, row_cache=row_cache, attention_streams=streams,
                                   compile_decode=not args.eager, aux_slots=args.aux_slots)

            fn = {
                "mlx": lambda a=nullctx: time_mlx(model, batch, args.context, args.steps, a),
                "engine": lambda a=nullctx: engine(a=a),
                "engine-overlap": lambda a=nullctx: engine(overlap=True, a=a),
                "engine-stagger": lambda a=nullctx: engine(stagger=1, a=a),
                "engine-spread": lambda a=nullctx: engine(overlap=True, stagger=args.context, a=a),
                "engine-warm": lambda a=nullctx: engine(warm=True, a=a),
                "engine-nosplit": lambda a=nullctx: no_split(lambda: engine(a=a)),
                "engine-warm-nosplit": lambda a=nullctx: no_split(lambda: engine(warm=True, a=a)),
            }[mode]
            fn()  # warm-up: compile kernels, fill the buffer cache
            r = fn()
            print(f"B={batch:4d} {label:21s} {r['ms']:7.2f} ms/step  {batch * 1e3 / r['ms']:8.0f} tok/s  "
                  f"build {r['build']:.2f}  submit {r['submit']:.2f}  wait {r['wait']:.2f}{r.get('extra', '')}", flush=True)
            if args.kernels:
                report: dict = {}
                fn(lambda: kernel_trace.traced(report))
                print(kernel_trace.summary(report, args.steps), flush=True)
            mx.clear_cache()


if __name__ == "__main__":
    main()
