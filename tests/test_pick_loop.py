"""``scripts/gpu/pick_loop.py``: the paged kernel loop a GPU A/B log says to use."""

from __future__ import annotations

import importlib.util
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pick_loop", ROOT / "scripts" / "gpu" / "pick_loop.py")
pick_loop = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_loop)

LOG = """rows    1 context  32768: mx.fast sdpa    63.3 us (2.12 TB/s)
rows    1 context  32768 launch (32, 8) (default): classic:1   159.6 (0.84 TB/s)  pipelined:1   150.6 (0.89 TB/s)  staged:1    80.0 (1.6 TB/s)  fast:1    10.0 (9 TB/s)  | max abs diff vs sdpa: classic:1 0.0001 pipelined:1 0.0001 staged:1 0.0001 fast:1 0.5
rows    1 context  32768 launch (32, 4): classic:1   220.6 (0.61 TB/s)  pipelined:1   189.9 (0.71 TB/s)  staged:1  FAILED x
rows   64 context    512 launch (1, 4) (default): classic:1   146.8 (0.91 TB/s)  pipelined:1   126.9 (1.06 TB/s)  staged:1   120.0 (1.1 TB/s)  fast:1    10.0 (9 TB/s)  | max abs diff vs sdpa: classic:1 0.0020 pipelined:1 0.0020 staged:1 0.0020 fast:1 0.0020
"""


def test_the_fastest_loop_that_agrees_with_sdpa_wins() -> None:
    winner, ratios = pick_loop.pick(LOG, "pipelined", 0.05, 0.01)
    assert winner == "staged"  # "fast" is faster but off by 0.5 from SDPA
    assert abs(ratios["staged"] - ((80.0 / 150.6) * (120.0 / 126.9)) ** 0.5) < 1e-9


def test_the_base_stays_unless_another_is_faster_by_the_margin() -> None:
    assert pick_loop.pick(LOG, "pipelined", 0.5, 0.01)[0] == "pipelined"
    assert pick_loop.pick(LOG.replace("staged:1   120.0", "staged:1  FAILED"), "pipelined", 0.05, 0.01)[0] == "pipelined"


def test_split_and_unsplit_launches_are_judged_apart() -> None:
    slow_unsplit = LOG.replace("staged:1   120.0", "staged:1   140.0")  # slower than pipelined's 126.9 at 64 rows
    assert pick_loop.pick(slow_unsplit, "pipelined", 0.05, 0.01, "split")[0] == "staged"  # 80 against 150.6 at 1 x 32k
    winner, ratios = pick_loop.pick(slow_unsplit, "pipelined", 0.05, 0.01, "unsplit")
    assert ratios["staged"] > 1 and winner == "fast"  # fast agrees with SDPA where it is judged now
    assert pick_loop.pick(slow_unsplit, "pipelined", 0.05, 0.01)[0] == "staged"  # by the mean of both
