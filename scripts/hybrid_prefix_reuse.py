"""A hybrid model's shared system prompt, request after request: cached tokens and time to the
first token, through the real service and client.

Each request is the same ``--system`` tokens, then ``--user`` tokens of its own, sent one after
another (each waits for the last), one new token each. An attention model restores the system
prompt from the second request on; a hybrid restores only where a state was saved, so this
shows where that happens (``scheduler/aux_state.py``'s snapshot points).

    python scripts/hybrid_prefix_reuse.py --shape qwen3-next-tiny --system 1000 --user 200
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.bench.models import synthetic_model  # noqa: E402
from runtime.bench.service import Service, ServiceSpec  # noqa: E402
from runtime.client import Client  # noqa: E402


async def _send(address: str, prompts: list[list[int]]) -> list[tuple[int, float]]:
    """(cached tokens, seconds to the one new token) of each prompt, one at a time."""
    out = []
    async with Client(address) as client:
        for prompt in prompts:
            t0 = time.perf_counter()
            res = await client.generate(token_ids=prompt, max_tokens=1, ignore_eos=True)
            assert res.error is None, res.error
            out.append((res.cached_tokens, time.perf_counter() - t0))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shape", default="qwen3-next-tiny")
    p.add_argument("--system", type=int, default=1000, help="shared system prompt tokens")
    p.add_argument("--user", type=int, default=200, help="each request's own tokens after it")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--work-dir", type=Path, default=Path(tempfile.gettempdir()) / "runtime-bench")
    args = p.parse_args()
    model = synthetic_model(args.shape, args.work_dir / "models", log=print)
    rng = random.Random(0)
    system = [rng.randrange(10, 1000) for _ in range(args.system)]
    prompts = [system + [rng.randrange(10, 1000) for _ in range(args.user)] for _ in range(args.requests)]
    spec = ServiceSpec(model=model, max_running=0, max_context=args.system + args.user + 8, kv_slots=0)
    with Service(spec, args.work_dir / "configs" / "hybrid-prefix-reuse.toml") as svc:
        rows = asyncio.run(_send(svc.address, prompts))
    print(f"{args.shape}: {args.requests} requests of a {args.system}-token system prompt + {args.user} own tokens")
    print("request  cached tokens  time to the token, ms")
    for i, (cached, secs) in enumerate(rows):
        print(f"{i:7d}  {cached:13d}  {1e3 * secs:21.1f}")
    later = [secs for _, secs in rows[2:]]
    if later:
        print(f"from the third on: median {1e3 * statistics.median(later):.1f} ms against the first's "
              f"{1e3 * rows[0][1]:.1f} ms")


if __name__ == "__main__":
    main()
