"""``scripts/gpu/pick_regs.py``: the split kernels' loop and register cap a ``kernel-regs`` log says to use."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("pick_regs", ROOT / "scripts" / "gpu" / "pick_regs.py")
pick_regs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pick_regs)


def _variant(loop: str, cap: int, one_row: list[float]) -> str:
    lines = [f"loop {loop}, split kernels' register cap {cap}"]
    for t in one_row:
        lines.append(f"rows    1 ctx 32768 slots 32776: paged (32, 8)    total {t:8.1f} us   [ {t - 5:.1f} k  5.0 c]")
        lines.append(f"rows    1 ctx 32768 slots 32776: paged read (32, 8) total {t - 9:8.1f} us   [x]")  # not the one timed
        lines.append("rows    1 ctx 32768 slots 32776: mx sdpa          total    10.0 us   [y]")
    lines.append("rows    8 ctx 32768 slots 262152: paged (4, 8)     total    20.0 us   [z]")  # one row only counts
    return "\n".join(lines) + "\n"


def test_the_fastest_variant_by_its_median_one_row_launch_wins() -> None:
    log = _variant("mma_ahead", 0, [66.5, 58.7]) + _variant("mma", 0, [60.0, 57.0]) + _variant("mma", 128, [52.0, 50.5])
    winner, times = pick_regs.pick(log, 0.03)
    assert winner == ("mma", 128)
    assert times == {("mma_ahead", 0): 62.6, ("mma", 0): 58.5, ("mma", 128): 51.25}
    # one fast outlier of two does not win on its own (session 24's log: mma 59.8 / 45.2 against 54.9 / 53.0)
    log = _variant("mma_ahead", 0, [54.9, 53.0]) + _variant("mma", 0, [59.8, 45.2])
    assert pick_regs.pick(log, 0.03)[0] == ("mma_ahead", 0)


def test_the_base_stays_unless_another_is_faster_by_the_margin() -> None:
    log = _variant("mma_ahead", 0, [58.7]) + _variant("mma", 168, [57.5])
    assert pick_regs.pick(log, 0.03)[0] == ("mma_ahead", 0)
    assert pick_regs.pick(log, 0.01)[0] == ("mma", 168)


def test_a_log_without_timings_is_an_error() -> None:
    with pytest.raises(ValueError):
        pick_regs.pick("loop mma, split kernels' register cap 0\nTraceback ...\n", 0.03)
