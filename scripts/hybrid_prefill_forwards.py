"""How many prefill forwards a hybrid's step runs, with its chunks grouped by start and with
chunks of different starts sharing a forward (``Engine.mixed_starts``), in process, on the pool
path a GPU takes; greedy tokens checked against mlx-lm's for every request.

Prompts of lognormal length and prompts on one system prompt arrive together, so a step carries
prompt heads, their tails past the tracking point, and prefix hits' suffixes.

    python scripts/hybrid_prefill_forwards.py --arch qwen3_next --prompts 12 --system 700
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

from harness import InProcessService  # noqa: E402
from model_factory import make_model, reference_greedy  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", default="qwen3_next", help="a model type of tests/model_factory.py (tiny, random weights)")
    p.add_argument("--prompts", type=int, default=12, help="prompts of lognormal length, and as many on the system prompt")
    p.add_argument("--system", type=int, default=700, help="the shared system prompt's tokens")
    p.add_argument("--seed", type=int, default=1)
    args = p.parse_args()
    folder = make_model(args.arch, Path(tempfile.gettempdir()) / f"hybrid-forwards-{args.arch}")
    for mixed in (False, True):
        svc = InProcessService(folder, max_running=2 * args.prompts + 8, aux_slots=8 * args.prompts, track_chunk=64,
                               max_step_tokens=2048, prefill_chunk=512, pad_shapes=True, row_cache=False,
                               max_context=4096, kv_slots=32768)
        svc.engine.mixed_starts = mixed and svc.engine.mixed_starts
        forwards: list[int] = []
        run = svc.engine._prefill_batch
        svc.engine._prefill_batch = lambda group: forwards.append(len(group)) or run(group)
        rng = random.Random(args.seed)
        ids = lambda n: [rng.randint(3, 200) for _ in range(n)]  # noqa: E731
        system = ids(args.system)
        own = [svc.request(f"a{i}", ids(min(2000, int(rng.lognormvariate(5.5, 0.6)))), 4) for i in range(args.prompts)]
        wave = [svc.request(f"b{i}", system + ids(rng.randint(16, 64)), 4) for i in range(args.prompts)]
        started = time.perf_counter()
        svc.run({0: own + wave})
        wall = time.perf_counter() - started
        wrong = [r.rid for r in own + wave if r.output_ids != reference_greedy(folder, r.prompt_ids, r.max_new)]
        print(f"{args.arch}, chunks {'of mixed starts share forwards' if svc.engine.mixed_starts else 'grouped by start'}: "
              f"{len(forwards)} prefill forwards for {sum(forwards)} chunks, {wall:.2f} s; "
              f"prefix hits {sum(r.prefix_len > 0 for r in wave)} of {len(wave)}; "
              f"tokens {'equal to mlx-lm' if not wrong else 'DIFFERENT in ' + ' '.join(wrong)}")


if __name__ == "__main__":
    main()
