"""A model whose forward cannot be traced by ``mx.compile`` (DBRX reads its expert choice back
with ``.tolist()``) is served uncompiled: the load-time probe marks its layout untraceable and
the engine builds no compiled decode for it, on the CPU row-cache path and on the kernel path
(run on the CPU with the kernels replaced by their reference computations); a traceable model
still gets both."""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from model_factory import reference_greedy
from test_paged_attention import _reference_kernels

from runtime.worker import decode_warmup
from runtime.worker.paths.prefill_warmup import warm_prefill


@pytest.mark.parametrize(("arch", "traceable"), [("dbrx", False), ("llama", True)])
def test_layout_marks_traceability_and_engine_compiles_only_traceable(arch, traceable, model_dir, monkeypatch):
    rows = InProcessService(model_dir(arch), max_running=8).engine
    assert rows.layout.traceable is traceable
    assert rows.paths.row_cache is not None and (rows.compiled is not None) is traceable
    _reference_kernels(monkeypatch)
    paged = InProcessService(model_dir(arch), max_running=8, row_cache=False).engine
    assert paged.paths.tail is not None  # the kernel path, where the compiled step would be built
    assert (paged.compiled_paged is not None) is traceable
    assert paged.fuse_prefill is traceable


@pytest.mark.parametrize("row_cache", [None, False], ids=["row-cache", "kernel-path"])
def test_untraceable_model_decodes_eager_as_mlx_lm(row_cache, model_dir, monkeypatch):
    """Requests joining others mid-decode, prefix hits among them, after the start-up warm-ups
    (with the GPU's prefill padding, so the prefill shapes' warm-up runs too)."""
    _reference_kernels(monkeypatch)
    folder = model_dir("dbrx")
    svc = InProcessService(folder, max_running=8, row_cache=row_cache, max_step_tokens=96, prefill_chunk=16)
    assert svc.engine.compiled is None and svc.engine.compiled_paged is None
    monkeypatch.setattr(decode_warmup, "ROW_WARM_S", 0.0)
    svc.engine.max_padding = 0.25  # the GPU's share
    decode_warmup.warm_decode(svc.engine, lambda line: None)
    assert warm_prefill(svc.engine, 96, 16) > 0
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    reqs = [svc.request(f"r{i}", shared[: 6 + 4 * i] + [rng.randrange(3, 250) for _ in range(2 + 3 * i)], 5 + i)
            for i in range(5)]
    svc.run({0: reqs[:2], 2: reqs[2:4], 3: reqs[4:]})
    assert sum(r.prefix_len > 0 for r in reqs) >= 2
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
