"""The ``paired`` bench workload: a service and mlx-lm loaded together, single streams alternated."""

from __future__ import annotations

import json

from runtime.bench.main import build_parser, run
from runtime.bench.paired import paired_ratios


def test_pair_ratios_skip_missing_values():
    assert paired_ratios([2.0, 3.0, 1.0, float("nan")], [1.0, 0.0, 4.0, 1.0]) == [2.0, 0.25]


def test_paired_workload_runs_both_sides_on_the_same_prompts(tmp_path, capsys):
    out = tmp_path / "paired.json"
    args = build_parser().parse_args([
        "--synthetic", "tiny", "--work-dir", str(tmp_path), "--workloads", "paired", "--pairs", "3",
        "--prompt-len", "24", "--gen-len", "6", "--blas", "bundled", "--json", str(out),
    ])
    assert run(args) == 0
    data = json.loads(out.read_text())["workloads"]["paired"]
    assert data["pairs"] == 3 and len(data["runtime"]) == 3 and len(data["mlx_lm"]) == 3
    assert data["tokens_match"] == [True, True, True]
    assert all(r["output_tokens"] == 6 for r in data["runtime"] + data["mlx_lm"])
    assert len(data["decode_tok_s_pair_ratios"]) == 3
    assert "single stream in 3 alternating pairs" in capsys.readouterr().out


def test_first_workload_starts_a_fresh_service_per_pair(tmp_path, capsys):
    out = tmp_path / "first.json"
    args = build_parser().parse_args([
        "--synthetic", "tiny", "--work-dir", str(tmp_path), "--workloads", "first", "--pairs", "2",
        "--prompt-len", "24", "--gen-len", "6", "--blas", "bundled", "--json", str(out),
    ])
    assert run(args) == 0
    data = json.loads(out.read_text())["workloads"]["first"]
    assert data["pairs"] == 2 and len(data["startup_s"]) == 2 and all(s > 0 for s in data["startup_s"])
    assert data["tokens_match"] == [True, True]
    assert all(r["output_tokens"] == 6 for r in data["runtime"] + data["mlx_lm"])
    assert len(data["decode_tok_s_pair_ratios"]) == 2
    assert "first request of a fresh service, 2 alternating pairs" in capsys.readouterr().out
