"""The paged kernel loop that won ``scripts/paged_kernel_ab.py``'s log: the geometric mean of each
loop's time over the cases' default launches, against ``--base``; prints the winner's name (the
base unless another is ``--margin`` faster and failed nowhere, and its largest difference from
SDPA is within ``--max-diff``).

    python3 scripts/gpu/pick_loop.py kernel-ab.log --base pipelined [--launches split]
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from collections import defaultdict


def pick(text: str, base: str, margin: float, max_diff: float, launches: str = "all") -> tuple[str, dict[str, float]]:
    """``launches``: the cases to judge by, "all", "split" (default launches of more than one
    split) or "unsplit"."""
    times: dict[str, list[float]] = defaultdict(list)
    failed: set[str] = set()
    worst_diff: dict[str, float] = defaultdict(float)
    cases = 0
    for line in text.splitlines():
        if "(default):" not in line:
            continue
        shape = re.search(r"launch \((\d+), \d+\) \(default\)", line)
        split = shape is not None and int(shape.group(1)) > 1
        if (launches == "split" and not split) or (launches == "unsplit" and split):
            continue
        cases += 1
        timing, _, diffs = line.partition("| max abs diff vs sdpa:")
        for name, value in re.findall(r"(\w+):\d+\s+([\d.]+|FAILED)", timing.split("(default):", 1)[1]):
            if value == "FAILED":
                failed.add(name)
            else:
                times[name].append(float(value))
        for name, value in re.findall(r"(\w+):\d+ ([\d.]+|-)", diffs):
            worst_diff[name] = max(worst_diff[name], float(value) if value != "-" else math.inf)
    ratios = {name: math.exp(sum(math.log(t / b) for t, b in zip(ts, times[base])) / len(ts))
              for name, ts in times.items() if len(ts) == cases and base in times}
    good = [name for name, r in ratios.items() if name != base and name not in failed
            and worst_diff[name] <= max_diff and r < 1 - margin]
    return (min(good, key=ratios.get) if good else base), ratios


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("log")
    p.add_argument("--base", default="pipelined")
    p.add_argument("--margin", type=float, default=0.05)
    p.add_argument("--max-diff", type=float, default=0.01)
    p.add_argument("--launches", choices=("all", "split", "unsplit"), default="all",
                   help="judge by the cases whose default launch is split (few rows, long contexts), unsplit, or all")
    args = p.parse_args()
    with open(args.log) as f:
        winner, ratios = pick(f.read(), args.base, args.margin, args.max_diff, args.launches)
    print(", ".join(f"{name} {r:.3f}" for name, r in sorted(ratios.items())), file=sys.stderr)
    print(winner)
    return 0


if __name__ == "__main__":
    sys.exit(main())
