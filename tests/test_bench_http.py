"""The ``http`` workload end to end: a real service with a gateway, many streams from several
client processes on both sides (``runtime.bench.client_processes``)."""

from __future__ import annotations

import json

from runtime.bench import client_processes
from runtime.bench.main import build_parser, run
from runtime.bench.mlx_server import free_port


def test_http_workload_spreads_many_streams_over_client_processes(tmp_path):
    streams = client_processes.STREAMS_PER_PROCESS + 4  # two processes per side
    out = tmp_path / "bench.json"
    args = build_parser().parse_args([
        "--synthetic", "tiny", "--work-dir", str(tmp_path), "--workloads", "http", "--blas", "bundled",
        "--http-streams", str(streams), "--prompt-len", "16", "--gen-len", "8",
        "--http-port", str(free_port()), "--http-pairs", "3", "--json", str(out),
    ])
    assert run(args) == 0
    http = json.loads(out.read_text())["workloads"]["http"]
    for side in ("zmq", "http"):
        assert len(http["tok_s"][side]) == 2 and all(v > 0 for v in http["tok_s"][side])
        assert len(http["itl_ms"][side]) == 3
    assert len(http["throughput_ratios"]) == 2
