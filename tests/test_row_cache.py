"""Decode through the dense row cache (the CPU path), token-exact against mlx-lm."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from harness import InProcessService
from model_factory import reference_greedy

from runtime.worker.decode_warmup import warm_decode
from runtime.worker.paths.rows import compiled_decode as cd
from runtime.worker.paths.rows import row_cache as rc


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "traced-each-step"])
@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_compact_and_scattered_rows_with_prefix_hits(arch, compiled, model_dir, monkeypatch):
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=4, compile_decode=compiled)
    assert svc.engine.paths.row_cache is not None, "the CPU decode path should use the row cache"
    assert (svc.engine.compiled is not None) == compiled
    seen = []
    if compiled:
        forward = cd.CompiledDecode.forward

        def spy_compiled(self, tokens, rows, positions, compact, length, *aux, **kw):
            seen.append((tuple(rows.tolist()), compact))
            return forward(self, tokens, rows, positions, compact, length, *aux, **kw)

        monkeypatch.setattr(cd.CompiledDecode, "forward", spy_compiled)
    else:
        write = rc.RowSpan.write

        def spy(self, layer, keys, values, *narrowing):
            if self.positions is not None and layer == 0:
                seen.append((tuple(self.rows), self.compact))
            return write(self, layer, keys, values, *narrowing)

        monkeypatch.setattr(rc.RowSpan, "write", spy)
    rng = random.Random(8)
    shared = [rng.randrange(3, 250) for _ in range(30)]
    reqs = [svc.request(f"r{i}", shared[: 10 + 5 * i] + [rng.randrange(3, 250) for _ in range(3 + i)], 4 + 6 * (i % 3))
            for i in range(8)]
    repeat = svc.request("repeat", list(reqs[0].prompt_ids), 6)  # a full-prompt hit
    svc.run({0: reqs[:4], 5: reqs[4:6], 9: reqs[6:] + [repeat]})
    assert any(compact for _, compact in seen) and any(not compact for _, compact in seen), seen
    assert sum(r.prefix_len > 0 for r in reqs) >= 2 and repeat.prefix_len == len(repeat.prompt_ids) - 1
    for r in reqs + [repeat]:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize("pending_steps", [64, 3])
def test_decode_tokens_reach_the_pool_for_later_prefix_hits(pending_steps, model_dir, monkeypatch):
    """Decode K/V live in the row cache and are copied into the pool later; a prompt that
    extends a finished request's whole sequence must still reuse exact K/V."""
    from runtime.worker.paths import attention_paths

    monkeypatch.setattr(attention_paths, "PENDING_STEPS", pending_steps)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=4)
    rng = random.Random(12)
    first = [svc.request(f"f{i}", [40 + i] + [rng.randrange(3, 250) for _ in range(8 + 5 * i)], 10 + 4 * i)
             for i in range(3)]
    svc.run({0: first})
    follow = [svc.request(f"g{i}", r.prompt_ids + r.output_ids[:-1] + [7, 8], 6) for i, r in enumerate(first)]
    svc.run({0: follow})
    for f, g in zip(first, follow):
        assert g.prefix_len > len(f.prompt_ids) + 5, (g.prefix_len, len(f.prompt_ids))
    for r in first + follow:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_start_up_warm_up_leaves_later_requests_exact(model_dir):
    """The worker's warm-up request (row 0, low pool slots) before the service takes requests."""
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=4)
    compiled = svc.engine.compiled
    assert svc.engine.paths.dense and compiled is not None
    assert warm_decode(svc.engine) == -(-compiled.max_context // compiled.length_bucket)  # one-row traces
    assert len(svc.engine.paths.pending) == 0
    rng = random.Random(3)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(5 + 7 * i)], 6) for i in range(3)]
    svc.run({0: reqs})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_scattered_rows_run_as_padded_compact_batches_exactly(model_dir, monkeypatch):
    """A scattered batch filling at least half of rows 0..R-1 runs compact with padding rows
    (``CompiledDecode.forward_padded``); its tokens stay mlx-lm's, and the padding rows'
    writes (the scratch position) never reach a row that is still in use."""
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=8)
    padded_calls = []
    forward_padded = cd.CompiledDecode.forward_padded

    def spy(self, tokens, rows, positions, length, padded):
        padded_calls.append((tuple(rows), padded))
        return forward_padded(self, tokens, rows, positions, length, padded)

    monkeypatch.setattr(cd.CompiledDecode, "forward_padded", spy)
    rng = random.Random(3)
    # Short and long replies: the short ones leave holes among rows 0..7 while the long ones decode.
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(6 + 3 * i)], 3 if i % 3 == 0 else 14)
            for i in range(8)]
    late = [svc.request(f"late{i}", [rng.randrange(3, 250) for _ in range(9)], 8) for i in range(2)]
    svc.run({0: reqs, 6: late})
    assert any(len(rows) < padded for rows, padded in padded_calls), padded_calls
    for r in reqs + late:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize("failing", ["trace", "forward"])
def test_a_compiled_step_that_fails_at_start_up_leaves_decode_uncompiled(model_dir, monkeypatch, capsys, failing):
    """A device on which MLX cannot compile or run the row-cache decode step (tracing it, or its
    first real run) starts serving uncompiled, with the reason on stderr, and stays exact."""
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=4)
    assert svc.engine.compiled is not None

    def fail(self, *args, **kwargs):
        if failing == "forward":  # a run that fails after writing its outputs into the row cache
            c = self.row_cache
            c.keys[:] = [mx.full(k.shape, float("nan"), dtype=k.dtype) for k in c.keys]
        raise RuntimeError("no kernel for this step")

    monkeypatch.setattr(cd.CompiledDecode, failing, fail)
    warm_decode(svc.engine)
    assert svc.engine.compiled is None
    assert "the compiled decode step failed at start-up (no kernel for this step)" in capsys.readouterr().err
    assert not any(mx.isnan(k).any().item() for k in svc.engine.paths.row_cache.keys)
    rng = random.Random(4)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(6 + 5 * i)], 7) for i in range(3)]
    svc.run({0: reqs[:1], 2: reqs[1:]})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
