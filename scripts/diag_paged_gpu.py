"""Diagnose a paged-attention greedy mismatch on one architecture (a GPU diagnosis tool).

Runs tests/test_paged_attention.py's scenario (two requests, a third joining at event 3) with
the CUDA kernel and with the gather path, prints each request's tokens against mlx-lm's, and
mlx-lm's top-2 logit margin at every position (a near-tie flips on rounding alone).
Usage: python scripts/diag_paged_gpu.py [arch]
"""

from __future__ import annotations

import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlx.core as mx  # noqa: E402
from harness import InProcessService  # noqa: E402
from model_factory import load_cached, make_model, reference_greedy  # noqa: E402

from runtime.worker.paths.paged_attention import PagedAttention  # noqa: E402


def margins(folder: Path, prompt: list[int], out: list[int]) -> list[float]:
    model, _ = load_cached(folder)
    logits = model(mx.array([prompt + out[:-1]]))[0, len(prompt) - 1:].astype(mx.float32)
    top = mx.sort(logits, axis=-1)[:, -2:]
    return [round(float(a - b), 5) for b, a in top.tolist()]


def scenario(folder: Path, kernel: bool, arrivals: str, cache: bool) -> list:
    original = PagedAttention.kernel_available
    if not kernel:
        PagedAttention.kernel_available = staticmethod(lambda: False)
    try:
        svc = InProcessService(folder, cache=cache, aux_slots=64, row_cache=False)
        rng = random.Random(2)
        reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(9 + 7 * i)], 8) for i in range(3)]
        plan = {"join3": {0: reqs[:2], 3: reqs[2:]}, "together": {0: reqs}, "alone": {0: reqs[2:]}}[arrivals]
        svc.run(plan)
        return [r for r in reqs if r.output_ids]
    finally:
        PagedAttention.kernel_available = original


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else "qwen3_next"
    folder = make_model(arch, Path(tempfile.mkdtemp()) / arch)
    print(f"device {mx.default_device()}, kernel available {PagedAttention.kernel_available()}")
    for kernel, arrivals, cache in [(True, "join3", False), (True, "together", False), (True, "alone", False),
                                    (True, "join3", True), (False, "join3", False)]:
        if True:
            if True:
                try:
                    reqs = scenario(folder, kernel, arrivals, cache)
                except Exception as exc:  # report and go on: this is a diagnosis
                    print(f"kernel={kernel} {arrivals} cache={cache}: raised {exc!r}")
                    continue
                for r in reqs:
                    ref = reference_greedy(folder, r.prompt_ids, 8)
                    same = r.output_ids == ref
                    line = f"kernel={kernel} {arrivals:8s} cache={cache} {r.rid}: {'same' if same else 'DIFF'}"
                    if not same:
                        line += f" got {r.output_ids} want {ref} margins {margins(folder, r.prompt_ids, ref)}"
                    print(line, flush=True)


if __name__ == "__main__":
    main()
