"""A step's prefill chunks and decode rows as one forward (``fused_step``, the CUDA kernel path),
run on the CPU with the kernels replaced by their reference computations: token-exact."""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from near_tie import assert_greedy_like_mlx
from test_paged_attention import _reference_kernels

from runtime.worker.engine import Engine
from runtime.worker.model.output_head import OutputHead


@pytest.mark.parametrize("padded", [False, True], ids=["exact-shapes", "gpu-padding"])
@pytest.mark.parametrize(("arch", "prefill_chunk"), [("llama", 16), ("qwen3", 256)])
def test_fused_steps_decode_as_mlx_lm(arch, prefill_chunk, padded, model_dir, monkeypatch):
    """``padded``: prefill batches padded as on a GPU (lengths and row counts rounded up, keys
    past position 0 padded at the front and masked), which the CPU does not do by itself."""
    _reference_kernels(monkeypatch)
    fused: list[tuple[int, int]] = []  # (prefill groups, decode rows) of every fused step
    submitting: list[bool] = []  # whether each fused forward was built inside ``submit``
    run_fused, submit = Engine._fused_logits, Engine.submit
    monkeypatch.setattr(Engine, "_fused_logits",
                        lambda self, groups, decode: fused.append((len(groups), len(decode.rows)))
                        or submitting.append(self.submitting) or run_fused(self, groups, decode))

    def flagged_submit(self, built):
        self.submitting = True
        try:
            return submit(self, built)
        finally:
            self.submitting = False

    monkeypatch.setattr(Engine, "submit", flagged_submit)
    monkeypatch.setattr(Engine, "submitting", False, raising=False)
    heads: list[int] = []  # the rows the output head computed in each fused forward
    first_rows = OutputHead.first_rows
    monkeypatch.setattr(OutputHead, "first_rows", lambda self, rows: heads.append(rows) or first_rows(self, rows))
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, row_cache=False, prefill_chunk=prefill_chunk, max_step_tokens=96)
    assert svc.engine.compiled_paged is not None
    svc.engine.fuse_prefill = True
    if padded:
        svc.engine.max_padding = 0.25  # the GPU's share
    rng = random.Random(11)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    reqs = [svc.request(f"r{i}", shared[: 10 + 6 * i] + [rng.randrange(3, 250) for _ in range(3 + 5 * i)], 6 + 3 * (i % 3))
            for i in range(7)]
    svc.run({0: reqs[:2], 2: reqs[2:4], 4: reqs[4:]})  # later ones arrive while earlier ones decode
    follow = svc.request("follow", reqs[1].prompt_ids + reqs[1].output_ids[:-1] + [7, 8, 9], 5)
    busy = svc.request("busy", [rng.randrange(3, 250) for _ in range(30)], 12)
    fresh = [svc.request(f"fresh{i}", [rng.randrange(3, 250) for _ in range(9 + 4 * i)], 4) for i in range(3)]
    # A prefix hit past a finished request's decode, and three new prompts batched as one
    # group of rows, fused beside busy's decode.
    svc.run({0: [busy], 1: [follow] + fresh})
    assert fused and any(rows >= 2 for _, rows in fused)
    assert not any(submitting)  # built with ``build``, while the step before it could still run
    assert svc.engine.output_head.found and len(heads) == len(fused)
    assert all(decode_rows <= rows < decode_rows + 8 for (_, decode_rows), rows in zip(fused, heads))  # padding rows only
    assert prefill_chunk > 16 or any(groups >= 2 for groups, _ in fused)  # chunks of several starts in one forward
    assert follow.prefix_len > len(reqs[1].prompt_ids) and sum(r.prefix_len > 0 for r in reqs) >= 2
    for r in reqs + [follow, busy] + fresh:
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)


def test_fusing_is_on_by_default_and_only_on_the_kernel_path(model_dir, monkeypatch):
    svc = InProcessService(model_dir("llama"), row_cache=True)
    assert svc.engine.compiled_paged is None and not svc.engine.fuse_prefill
    _reference_kernels(monkeypatch)
    svc = InProcessService(model_dir("llama"), row_cache=False)
    assert svc.engine.compiled_paged is not None and svc.engine.fuse_prefill


@pytest.mark.parametrize("early", [True, False], ids=["built-early", "built-in-prepare"])
def test_a_step_of_many_prefill_tokens_runs_its_forwards_apart(model_dir, monkeypatch, early):
    """(``early``: ``BUILD_FUSED_EARLY``, the fused forward built by ``build`` or by ``prepare``.)"""
    from runtime.worker import engine as engine_mod

    _reference_kernels(monkeypatch)
    monkeypatch.setattr(engine_mod, "FUSE_MAX_TOKENS", 8)
    monkeypatch.setattr(engine_mod, "BUILD_FUSED_EARLY", early)
    fused = []  # whether each fused forward was built by ``prepare``
    run_fused, prepare = Engine._fused_logits, Engine.prepare
    monkeypatch.setattr(Engine, "prepare", lambda self, launched: setattr(self, "preparing", True)
                        or prepare(self, launched) or setattr(self, "preparing", False))
    monkeypatch.setattr(Engine, "preparing", False, raising=False)
    monkeypatch.setattr(Engine, "_fused_logits", lambda self, *a: fused.append(self.preparing) or run_fused(self, *a))
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=8, row_cache=False)
    svc.engine.fuse_prefill = True
    busy = svc.request("busy", list(range(3, 23)), 10)
    small = svc.request("small", list(range(40, 46)), 4)  # 5 tokens before the last: fused
    large = svc.request("large", list(range(60, 90)), 4)  # 29: apart
    svc.run({0: [busy], 1: [small], 5: [large]})
    assert fused == [not early]
    for r in (busy, small, large):
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)
