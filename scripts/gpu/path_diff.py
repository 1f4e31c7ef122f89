"""Where a tiny model's greedy tokens part from mlx-lm's, path by path (a GPU diagnosis).

Builds the tests' tiny ``--arch`` model (float32 unless ``--dtype``), serves the same requests
through the worker's decode paths (the kernel, one request at a time, the row cache, unpadded
shapes) and prints, per request, the first output position that differs from mlx-lm's greedy
tokens and mlx-lm's logprob gap there. ``python scripts/gpu/path_diff.py --arch gpt_oss --window 64``
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))

from harness import InProcessService  # noqa: E402
from model_factory import make_model, reference_greedy  # noqa: E402
from near_tie import logprob_gap  # noqa: E402

MODES = {  # name: InProcessService keywords, and whether requests arrive one at a time
    "kernel": ({}, False),
    "kernel-alone": ({}, True),
    "row-cache": ({"row_cache": True}, False),
    "unpadded": ({"pad_shapes": False}, False),
    "eager": ({"compile_decode": False}, False),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--arch", default="gpt_oss")
    p.add_argument("--window", type=int, default=64)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32")
    p.add_argument("--prompts", default="120,70,40")
    p.add_argument("--new", type=int, default=40)
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--experts", type=int, default=0,
                   help="gpt_oss: this many experts, every one active for every token (no routing choice)")
    args = p.parse_args()
    experts = {"num_local_experts": args.experts, "num_experts_per_tok": args.experts} if args.experts else {}
    folder = make_model(args.arch, Path(tempfile.mkdtemp()) / args.arch, dtype=args.dtype,
                        sliding_window=args.window, head_dim=args.head_dim, **experts)
    rng = random.Random(8)
    prompts = [[rng.randrange(3, 250) for _ in range(int(n))] for n in args.prompts.split(",")]
    refs = [reference_greedy(folder, prompt, args.new) for prompt in prompts]
    for mode in args.modes.split(","):
        kwargs, alone = MODES[mode]
        svc = InProcessService(folder, max_running=8, **kwargs)
        paths = svc.engine.paths
        where = "kernel" if paths.device_table is not None else "row cache" if paths.dense else "pool gather"
        reqs = [svc.request(f"r{i}", prompt, args.new) for i, prompt in enumerate(prompts)]
        if alone:
            for r in reqs:
                svc.run({0: [r]})
        else:
            svc.run({0: reqs[:2], 4: reqs[2:]})
        for r, prompt, ref in zip(reqs, prompts, refs):
            got = r.output_ids
            k = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), None)
            if k is None:
                print(f"{mode:13s} ({where}) {r.rid}: same {len(got)} tokens", flush=True)
                continue
            gap = logprob_gap(folder, list(prompt) + ref[:k], ref[k], got[k])
            print(f"{mode:13s} ({where}) {r.rid}: parts at {k} (prompt {len(prompt)}), gap {gap:.4g} nats", flush=True)


if __name__ == "__main__":
    main()
