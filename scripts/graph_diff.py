"""Count the primitives of one decode step: mlx-lm's (``KVCache``) against the worker's Engine.

A host-bound step pays MLX's encoding per primitive, kernel or not (a reshape costs host time
too), so where our step encodes fewer kernels yet takes longer to submit (session 39: latent
attention and Qwen3-Next widths at one row), the primitives that differ say where to look.
Counts come from ``mx.export_to_dot`` of each step's lazy outputs (its node labels), on
whatever device MLX runs; the engine's step is captured at its ``mx.async_eval``.

    python scripts/graph_diff.py --shape qwen3-next-24l-dense
    python scripts/graph_diff.py --shape moonlight-16b-8e --compiled
"""

from __future__ import annotations

import argparse
import collections
import re
import tempfile
from pathlib import Path

import mlx.core as mx
import profile_decode


def _flat(value, out: list[mx.array]) -> list[mx.array]:
    if isinstance(value, mx.array):
        out.append(value)
    elif isinstance(value, (list, tuple)):
        for item in value:
            _flat(item, out)
    return out


def count(arrays, path: Path) -> collections.Counter:
    """Primitive labels of the graph behind ``arrays`` (not yet evaluated), with how many of each."""
    mx.export_to_dot(str(path), *_flat(arrays, []))
    text = path.read_text()
    counts = collections.Counter(re.findall(r'label ="([^"]+)"', text))
    # inputs: weights (the same on both sides) and arrays made on the host for this step, each a
    # copy to the device on a GPU
    counts["(input arrays)"] = len(re.findall(r"rank=source", text))
    return counts


def mlx_step(model, batch: int, context: int, folder: Path) -> collections.Counter:
    """mlx-lm's decode step after a prompt of ``context`` tokens, as ``generate_step`` builds it."""
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(model)
    mx.eval(model(mx.random.randint(0, 1000, (batch, context)), cache=cache))
    logits = model(mx.zeros((batch, 1), dtype=mx.int32), cache=cache)[:, -1, :]
    token = mx.argmax(logits - mx.logsumexp(logits, axis=-1, keepdims=True), axis=-1)
    counts = count([token] + [c.state for c in cache], folder / "mlx.dot")
    mx.eval(token)
    return counts


def engine_step(model, batch: int, context: int, compiled: bool, folder: Path) -> collections.Counter:
    """The Engine's last decode step of a short chained run (``profile_decode.time_engine``)."""
    seen: list[collections.Counter] = []
    launch = mx.async_eval

    def spy(*arrays):
        seen.append(count(arrays, folder / f"engine-{len(seen)}.dot"))
        return launch(*arrays)

    mx.async_eval = spy
    try:
        profile_decode.time_engine(model, batch, context, 3, overlap=True, slots_total=0, warm=True,
                                   compile_decode=compiled)
    finally:
        mx.async_eval = launch
    return seen[-1]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shape", default="tiny")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--context", type=int, default=256)
    p.add_argument("--compiled", action="store_true", help="the engine's compiled step (default: eager, every primitive)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=JSON", help="as profile_decode.py's")
    args = p.parse_args()
    import json

    overrides = {key: json.loads(value) for key, value in (item.split("=", 1) for item in args.set)}
    model, _ = profile_decode.make_model(args.shape, overrides)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp)
        ours = engine_step(model, args.batch, args.context, args.compiled, folder)
        theirs = mlx_step(model, args.batch, args.context, folder)
    print(f"device {mx.default_device()}, shape {args.shape}, {args.batch} row(s) at {args.context}, engine "
          f"{'compiled' if args.compiled else 'eager'}: {sum(ours.values()) - ours['(input arrays)']} primitives "
          f"against mlx-lm's {sum(theirs.values()) - theirs['(input arrays)']}")
    print(f"{'primitive':60s} {'mlx-lm':>7s} {'engine':>7s}")
    for name in sorted(set(ours) | set(theirs), key=lambda k: -(abs(ours[k] - theirs[k]))):
        if ours[name] != theirs[name]:
            print(f"{name[:60]:60s} {theirs[name]:7d} {ours[name]:7d}")


if __name__ == "__main__":
    main()
