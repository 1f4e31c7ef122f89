"""Count the graph nodes of a decode step that carries prefill: separate forwards or fused.

Runs on the CPU with the paged kernel replaced by a stand-in of one node per output (the
kernel path's bookkeeping as on a GPU: device slot table, decode tail, the GPU's prefill
padding), a random-weight llama of ``--layers`` layers, eight requests decoding and three
arriving. Every node of every graph the step evaluates is counted (``mx.export_to_dot``):
host work on a GPU grows with nodes (MLX encodes each), so fewer is the point of fusing.
The CPU lowers RMSNorm and RoPE to several nodes each where a GPU has one, so its counts
overstate what both ways share.

    python scripts/step_nodes.py --layers 32
"""

from __future__ import annotations

import argparse
import random
import re
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import mlx.core as mx  # noqa: E402
from harness import InProcessService  # noqa: E402
from model_factory import make_model  # noqa: E402

from runtime.worker import engine as engine_mod  # noqa: E402
from runtime.worker.paths import attention_paths  # noqa: E402
from runtime.worker.paths.paged_attention import PagedAttention  # noqa: E402


def _nodes(arrays: list[mx.array], path: Path) -> int:
    mx.export_to_dot(str(path), *arrays)
    return len(re.findall(r'label ="?[A-Za-z_]+', path.read_text()))


def _stand_in_kernels() -> None:
    def append(self, inputs, scale, launch, rope=None, sinks=None):
        queries, *_, tail_keys, tail_values, _, _, _ = inputs
        return mx.sort(queries, axis=-1), mx.sort(tail_keys, axis=-1), mx.sort(tail_values, axis=-1)

    PagedAttention.kernel_available = staticmethod(lambda: True)
    PagedAttention._append_attend = append
    PagedAttention.supports = lambda self, head_dim: self.use_kernel
    PagedAttention.warm_up = lambda self, *a, **k: None
    attention_paths.AttentionPaths._check_kernel = lambda self, *a, **k: None


def count(folder: Path, fuse: bool, work: Path) -> list[tuple[int, int, int, int]]:
    """(prefill chunks, prefill tokens, decode rows, graph nodes) of every step with both."""
    svc = InProcessService(folder, max_running=16, row_cache=False, max_context=512, kv_slots=16384)
    svc.engine.fuse_prefill = fuse
    svc.engine.max_padding = 0.25  # the GPU's
    counts = []
    submit = engine_mod.Engine.submit

    def counting_submit(self, built):
        step = built.step
        if step is not None and step.prefills and step.decode is not None and len(step.decode.rows) >= 4:
            evaluated = []
            real_eval = mx.eval
            mx.eval = lambda *arrays: evaluated.append(_nodes(list(arrays), work / "g.dot")) or real_eval(*arrays)
            try:
                self.prepare(built)
            finally:
                mx.eval = real_eval
            targets = [t for t in (built.written, built.tokens, built.logits) if t is not None]
            counts.append((len(step.prefills), sum(len(c.token_ids) for c in step.prefills), len(step.decode.rows),
                           sum(evaluated) + _nodes(targets, work / "s.dot")))
        return submit(self, built)

    engine_mod.Engine.submit = counting_submit
    try:
        rng = random.Random(1)
        early = [svc.request(f"e{i}", [rng.randrange(3, 250) for _ in range(20)], 30) for i in range(8)]
        late = [svc.request(f"l{i}", [rng.randrange(3, 250) for _ in range(30 + 7 * i)], 4) for i in range(3)]
        svc.run({0: early, 3: late})
    finally:
        engine_mod.Engine.submit = submit
    return counts


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=32)
    args = p.parse_args()
    _stand_in_kernels()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        folder = make_model("llama", work / "model", check=False, num_hidden_layers=args.layers, dtype="bfloat16")
        for fuse in (False, True):
            for chunks, tokens, rows, nodes in count(folder, fuse, work):
                print(f"{'fused' if fuse else 'separate':8s} {chunks} prefill chunks ({tokens} tokens), "
                      f"{rows} decode rows: {nodes} graph nodes")


if __name__ == "__main__":
    main()
