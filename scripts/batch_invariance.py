"""Where batched greedy decode parts from mlx-lm's one-row greedy, and by how much.

Runs the 32-request shared-prefix scenario of ``tests/test_prefix_cache_exact.py`` in process
(rows 8, then rows 1) for each architecture given, and for every request whose tokens differ
from mlx-lm's ``generate_step`` prints the first differing position and mlx-lm's own logprob
gap there between its token and ours. A gap near zero is a near-tie (rounding in a kernel
chosen by batch size); a wide gap is a bug. Run on a GPU: ``python3 scripts/batch_invariance.py
llama qwen3``.
"""

from __future__ import annotations

import random
import sys
import tempfile

import mlx.core as mx

sys.path.insert(0, "tests")
from harness import InProcessService  # noqa: E402
from model_factory import load_cached, make_model, reference_greedy  # noqa: E402


def gap(folder, context: list[int], ref_token: int, our_token: int) -> float:
    """mlx-lm's logprob of its token minus ours after ``context`` (a full forward)."""
    model, _ = load_cached(folder)
    logits = model(mx.array(context, dtype=mx.uint32)[None])[0, -1].astype(mx.float32)
    logprobs = logits - mx.logsumexp(logits)
    return float(logprobs[ref_token] - logprobs[our_token])


def scenario(folder, rows: int, cache: bool) -> list[tuple[str, int, float]]:
    rng = random.Random(5)
    prefixes = [[rng.randrange(3, 250) for _ in range(rng.randint(20, 60))] for _ in range(4)]
    svc = InProcessService(folder, kv_slots=600, max_running=rows, prefill_chunk=32, max_step_tokens=64, cache=cache)
    rng = random.Random(9)
    reqs, arrivals = [], {}
    for i in range(32):
        prompt = prefixes[i % 4] + [rng.randrange(3, 250) for _ in range(rng.randint(1, 16))]
        r = svc.request(f"r{i}", prompt, rng.randint(4, 16))
        reqs.append(r)
        arrivals.setdefault(rng.randint(0, 40), []).append(r)
    svc.run(arrivals)
    differ = []
    for r in reqs:
        ref = reference_greedy(folder, r.prompt_ids, r.max_new)
        if r.output_ids != ref:
            k = next(i for i, (a, b) in enumerate(zip(r.output_ids, ref)) if a != b)
            differ.append((r.rid, k, gap(folder, list(r.prompt_ids) + ref[:k], ref[k], r.output_ids[k])))
    return differ


def main(archs: list[str]) -> None:
    print(f"device {mx.default_device()}", flush=True)
    for arch in archs:
        for dtype in ("float32", "bfloat16"):
            folder = make_model(arch, tempfile.mkdtemp(), dtype=dtype)
            for rows, cache in ((8, False), (8, True), (1, False)):
                differ = scenario(folder, rows, cache)
                gaps = [g for _, _, g in differ]
                print(f"{arch} {dtype} rows {rows} cache {cache}: {len(differ)}/32 differ"
                      + (f"; max gap {max(gaps):.3g} nats; " if gaps else "")
                      + ", ".join(f"{rid}@{k} gap {g:.3g}" for rid, k, g in differ[:8]), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:] or ["llama", "qwen3"])
