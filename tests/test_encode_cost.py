"""``scripts/encode_cost.py``: host time per primitive kind (for weighing ``graph_diff`` counts)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import mlx.core as mx

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("encode_cost", ROOT / "scripts" / "encode_cost.py")
encode_cost = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(encode_cost)


def test_every_kind_builds_its_primitives_and_is_timed_per_primitive():
    table = encode_cost.kinds()
    assert {"add", "take (gather)", "scatter (chained)", "slice_update (chained)", "compiled (3 ops fused)"} <= set(table)
    assert ("custom kernel" in table) == (mx.default_device() == mx.gpu)  # a CPU has no custom kernels
    for name, build in table.items():
        outs = build(3)
        mx.eval(outs)
        assert outs and all(isinstance(o, mx.array) for o in outs), name
    # a chained update writes every step: 3 scatters of rows 3, 5 (+0, +1, +2)
    pool = table["scatter (chained)"](3)[0]
    assert mx.any(pool[3:8] != 0).item() and not mx.any(pool[8:]).item()
    t = encode_cost.time_kind(table["add"], count=4, repeats=2)
    assert set(t) == {"build", "submit", "first_submit"} and all(v >= 0 for v in t.values())
