"""Diagnose a paged-attention greedy mismatch on one architecture (a GPU diagnosis tool).

Runs tests/test_paged_attention.py's scenario (two requests, a third joining at event 3) with
the CUDA kernel and with the gather path, prints each request's tokens against mlx-lm's, and
mlx-lm's own logprob gap at the first difference (a near-tie flips on rounding alone).
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
from model_factory import make_model, reference_greedy  # noqa: E402
from near_tie import logprob_gap  # noqa: E402

from runtime.worker.paths.paged_attention import PagedAttention  # noqa: E402


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
        try:
            reqs = scenario(folder, kernel, arrivals, cache)
        except Exception as exc:  # report and go on: this is a diagnosis
            print(f"kernel={kernel} {arrivals} cache={cache}: raised {exc!r}")
            continue
        for r in reqs:
            ref = reference_greedy(folder, r.prompt_ids, 8)
            line = f"kernel={kernel} {arrivals:8s} cache={cache} {r.rid}: "
            k = next((i for i, (a, b) in enumerate(zip(r.output_ids, ref)) if a != b), None)
            if k is None:
                line += "same"
            else:  # mlx-lm's own logprob of its token minus ours there (a near-tie is a few thousandths)
                gap = logprob_gap(folder, list(r.prompt_ids) + ref[:k], ref[k], r.output_ids[k])
                line += f"DIFF at {k}: got {r.output_ids} want {ref}, mlx-lm's gap {gap:.5f} nats"
            print(line, flush=True)

if __name__ == "__main__":
    main()
