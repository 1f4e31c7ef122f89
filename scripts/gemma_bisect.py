"""Which of the worker's load-time changes or decode paths parts a model's greedy tokens from
mlx-lm's, one change switched off at a time.

Runs one prompt through mlx-lm's ``generate_step`` (the reference), through mlx-lm's
``generate_step`` on the model as the worker loads it (its load-time transformations alone),
and through the in-process service with each transformation or the decode mask switched off in
turn. For each it prints how many tokens match and, at the first that differs, mlx-lm's own
logprob gap between its token and ours (near zero: a near-tie; wide: a bug).

    python3 scripts/gemma_bisect.py --shape gemma3-1b --prompt 256 --new 48
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import time
from pathlib import Path

import mlx.core as mx

sys.path.insert(0, "tests")
from harness import InProcessService  # noqa: E402

from runtime.bench.models import synthetic_model  # noqa: E402
from runtime.config import parse_config  # noqa: E402
from runtime.worker import loader  # noqa: E402
from runtime.worker.paths import attention_paths  # noqa: E402


def mlx_lm_greedy(model, prompt: list[int], new: int, chunk: int = 2048) -> tuple[list[int], list[mx.array]]:
    """mlx-lm's greedy tokens and its logprobs at each step (``chunk``: its prefill step size)."""
    from mlx_lm.generate import generate_step

    tokens, logprobs = [], []
    for tok, lp in generate_step(mx.array(prompt, dtype=mx.uint32), model, max_tokens=new,
                                 sampler=lambda x: mx.argmax(x, axis=-1), prefill_step_size=chunk):
        tokens.append(int(tok))
        logprobs.append(lp.astype(mx.float32))
    return tokens, logprobs


def report(name: str, ours: list[int], ref: list[int], logprobs: list[mx.array], seconds: float) -> None:
    same = sum(a == b for a, b in zip(ours, ref))
    k = next((i for i, (a, b) in enumerate(zip(ours, ref)) if a != b), None)
    where = "all match" if k is None else (
        f"first differs at {k}: gap {float(logprobs[k][ref[k]] - logprobs[k][ours[k]]):.4f} nats")
    print(f"{name:28s} {same:3d}/{len(ref)} match, {where} ({seconds:.1f} s)", flush=True)


@contextlib.contextmanager
def patched(obj, name: str, value):
    old = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, old)


def service_tokens(folder: Path, prompt: list[int], new: int, fuse: str, padded: str = "auto") -> list[int]:
    """``padded``: "auto" (the device's default), "off" (``worker.pad_shapes = "off"``) or
    "decode" (shapes padded, but prefill forwards at the prompt's own length)."""
    svc = InProcessService(folder, kv_slots=len(prompt) + new + 1024, max_running=1, max_context=len(prompt) + new + 16,
                           max_step_tokens=2048, prefill_chunk=512, fuse=fuse,
                           pad_shapes={"auto": None, "off": False, "decode": True}[padded])
    if padded == "decode":
        svc.engine.max_padding = 0.0
    req = svc.request("r0", prompt, new)
    svc.run({0: [req]})
    return list(req.output_ids)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", default="gemma3-1b")
    ap.add_argument("--prompt", type=int, default=256)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work-dir", default="/tmp/runtime-bench")
    args = ap.parse_args()
    print(f"device {mx.default_device()}, shape {args.shape}, prompt {args.prompt}, new {args.new}", flush=True)
    folder = synthetic_model(args.shape, Path(args.work_dir), log=lambda m: print(m, flush=True))
    rng = random.Random(args.seed)
    prompt = [rng.randrange(10, 1000) for _ in range(args.prompt)]

    from mlx_lm.utils import load_model

    t = time.perf_counter()
    model, _ = load_model(folder)
    ref, logprobs = mlx_lm_greedy(model, prompt, args.new)
    report("mlx-lm (reference)", ref, ref, logprobs, time.perf_counter() - t)
    top2 = [sorted(lp.tolist())[-2:] for lp in logprobs[:8]]
    print("  its top-2 logprob gaps, first 8 steps: " + ", ".join(f"{b - a:.4f}" for a, b in top2), flush=True)
    # The rounding floor: mlx-lm itself with the prompt cut into other prefill chunks (other
    # matrix shapes, so other kernels). Tokens that part here part at rounding, not at a bug.
    for chunk in (64, 100):
        t = time.perf_counter()
        ours, _ = mlx_lm_greedy(model, prompt, args.new, chunk)
        report(f"mlx-lm, prefill chunks of {chunk}", ours, ref, logprobs, time.perf_counter() - t)
    del model
    mx.clear_cache()

    config = parse_config({"model": {"path": str(folder)}, "worker": {"fuse_projections": "auto"},
                           "scheduler": {"max_running": 1, "max_context": args.prompt + args.new + 16},
                           "cache": {"kv_slots": args.prompt + args.new + 1024}})
    t = time.perf_counter()
    loaded = loader.load(config)
    print(f"  loaded: fused groups {loaded.fused_groups}, residual blocks {loaded.residual_blocks} "
          f"({loaded.residual_kernel}), norm offsets {loaded.norm_offsets}", flush=True)
    ours, _ = mlx_lm_greedy(loaded.model, prompt, args.new)
    report("mlx-lm on the loaded model", ours, ref, logprobs, time.perf_counter() - t)
    del loaded
    mx.clear_cache()

    no_residuals = (loader, "fuse_residuals", lambda *a, **k: 0)
    no_offsets = (loader, "precompute_offsets", lambda *a, **k: 0)
    no_mask = (attention_paths, "decode_mask", lambda *a, **k: None)  # safe only inside the window
    variants = [
        ("service", "auto", []),
        ("service, pad_shapes off", "auto", ["off"]),
        ("service, prefill unpadded only", "auto", ["decode"]),
        ("service, projections apart", "off", []),
        ("service, no fused residual", "auto", [no_residuals]),
        ("service, no norm offsets", "auto", [no_offsets]),
        ("service, no decode mask", "auto", [no_mask]),
        ("service, none of them", "off", [no_residuals, no_offsets, no_mask]),
    ]
    for name, fuse, patches in variants:
        t = time.perf_counter()
        with contextlib.ExitStack() as stack:
            for obj, attr, value in (p for p in patches if isinstance(p, tuple)):
                stack.enter_context(patched(obj, attr, value))
            padded = next((p for p in patches if isinstance(p, str)), "auto")
            try:
                ours = service_tokens(folder, prompt, args.new, fuse, padded)
            except Exception as e:  # noqa: BLE001 - a diagnosis script reports and goes on
                print(f"{name:28s} failed: {type(e).__name__}: {e}", flush=True)
                continue
        report(name, ours, ref, logprobs, time.perf_counter() - t)
        mx.clear_cache()


if __name__ == "__main__":
    main()
