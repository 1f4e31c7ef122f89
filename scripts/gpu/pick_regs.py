"""The split kernels' loop and register cap that won the ``kernel-regs`` plan item's log: per
variant (a ``loop X, split kernels' register cap N`` line of ``scripts/kernel_bench.py``, then its
cases), the median of its one-row appending launches (``rows 1 ... paged (S, W) total T us``:
one outlier of two reps moved the minimum by a quarter on an H200, session 24); prints
``LOOP CAP`` of the winner, the base (the first variant) unless another is ``--margin`` faster.

    python3 scripts/gpu/pick_regs.py kernel-regs.log [--margin 0.03]
"""

from __future__ import annotations

import argparse
import re
import statistics
import sys


def pick(text: str, margin: float) -> tuple[tuple[str, int], dict[tuple[str, int], float]]:
    runs: dict[tuple[str, int], list[float]] = {}
    order: list[tuple[str, int]] = []
    variant = None
    for line in text.splitlines():
        head = re.match(r"loop (\S+), split kernels' register cap (\d+)", line)
        if head:
            variant = (head.group(1), int(head.group(2)))
            order.append(variant)
            continue
        case = re.match(r"rows +1 ctx \d+ slots \d+: paged \(\d+, \d+\) +total +([\d.]+) us", line)
        if case and variant is not None:
            runs.setdefault(variant, []).append(float(case.group(1)))
    best = {v: statistics.median(t) for v, t in runs.items()}
    timed = [v for v in order if v in best]
    if not timed:
        raise ValueError("no timed variant in the log")
    base = timed[0]
    winner = min(timed, key=lambda v: best[v])
    return (winner if best[winner] < best[base] * (1 - margin) else base), best


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("log")
    p.add_argument("--margin", type=float, default=0.03)
    args = p.parse_args()
    with open(args.log) as f:
        (loop, cap), times = pick(f.read(), args.margin)
    print(", ".join(f"{v[0]}/{v[1]} {t:.1f} us" for v, t in times.items()), file=sys.stderr)
    print(f"{loop} {cap}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
