"""RUNTIME_WORKER_TRACE: the worker's per-phase host times, written when it exits."""

from __future__ import annotations

import re

from conftest import running_service
from model_factory import reference_greedy

from runtime.client import SyncClient

EXTRA = "[scheduler]\nmax_running = 4\nmax_context = 128\n[cache]\nkv_slots = 512\n"


def test_trace_counts_every_step_and_the_frozen_start_up_heap(model_dir, tmp_path, monkeypatch):
    folder = model_dir("llama")
    monkeypatch.setenv("RUNTIME_WORKER_TRACE", str(tmp_path / "trace"))
    with running_service(tmp_path, folder, EXTRA) as svc:
        with SyncClient(svc.address, timeout_s=60) as client:
            result = client.generate(token_ids=[5, 6, 7], max_tokens=6, ignore_eos=True)
            status = client.status()
    assert result.token_ids == reference_greedy(folder, [5, 6, 7], 6)
    traces = list(tmp_path.glob("trace.*"))
    assert len(traces) == 1, "the worker writes one trace file when it stops"
    text = traces[0].read_text()
    counts = {m.group(1): int(m.group(2)) for m in re.finditer(r"^(build|submit|finalize|send)\s+(\d+)", text, re.M)}
    # Every step was built, submitted, read back and reported once; steps planned ahead of the
    # request's end may still finish after the status query, so the scheduler's count is a floor.
    assert counts["build"] == counts["submit"] == counts["finalize"] == counts["send"] >= status.steps > 0
    frozen = int(re.search(r"gc: (\d+) objects frozen", text).group(1))
    assert frozen > 10000, "the loaded model and libraries are moved out of the collector's reach"
