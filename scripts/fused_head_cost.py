"""Wall time of fused prefill + decode steps with the output head over the decode rows only
(``OutputHead.first_rows``, the default) or over every row, on the CPU.

The paged kernel is replaced by a stand-in (``step_nodes``), so this times the rest of the
forward; a random-weight llama with a real vocabulary size makes the head's share visible.
Runs the same requests both ways, alternating, and prints each run's fused-step seconds.

    python scripts/fused_head_cost.py --vocab 32000 --rounds 3
"""

from __future__ import annotations

import argparse
import contextlib
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
from harness import InProcessService  # noqa: E402
from model_factory import make_model  # noqa: E402
from step_nodes import _stand_in_kernels  # noqa: E402

from runtime.worker.engine import Engine  # noqa: E402
from runtime.worker.model.output_head import OutputHead  # noqa: E402


def fused_seconds(folder: Path, sliced: bool) -> tuple[float, int]:
    """Seconds inside fused steps (built and evaluated) over one workload, and their count."""
    svc = InProcessService(folder, max_running=16, row_cache=False, max_context=1024, kv_slots=16384,
                           max_step_tokens=512, prefill_chunk=480)
    svc.engine.max_padding = 0.25
    spent, count = [0.0], [0]
    fused = Engine._fused_logits

    def timed(self, groups, decode):
        t = time.perf_counter()
        logits, in_place = fused(self, groups, decode)
        mx.eval(logits)
        spent[0] += time.perf_counter() - t
        count[0] += 1
        return logits, in_place

    Engine._fused_logits = timed
    first_rows = OutputHead.first_rows
    if not sliced:
        OutputHead.first_rows = lambda self, rows: contextlib.nullcontext()
    try:
        rng = random.Random(1)
        busy = [svc.request(f"b{i}", [rng.randrange(3, 250) for _ in range(16)], 40) for i in range(8)]
        late = [svc.request(f"l{i}", [rng.randrange(3, 250) for _ in range(460)], 2) for i in range(4)]
        svc.run({0: busy, 3: late[:1], 6: late[1:2], 9: late[2:3], 12: late[3:]})
    finally:
        Engine._fused_logits, OutputHead.first_rows = fused, first_rows
    return spent[0], count[0]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    _stand_in_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        folder = make_model("llama", Path(tmp) / "model", check=False, num_hidden_layers=args.layers,
                            hidden_size=args.hidden, intermediate_size=4 * args.hidden, vocab_size=args.vocab)
        fused_seconds(folder, True)  # warm-up
        for r in range(args.rounds):
            for sliced in ((True, False) if r % 2 == 0 else (False, True)):
                s, n = fused_seconds(folder, sliced)
                print(f"round {r} head over {'decode rows' if sliced else 'every row ':11s}: "
                      f"{n} fused steps, {s * 1e3:8.1f} ms, {s / max(n, 1) * 1e3:6.1f} ms each", flush=True)


if __name__ == "__main__":
    main()
