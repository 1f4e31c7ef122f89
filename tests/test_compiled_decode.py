"""The compiled row-cache decode: traced once per batch shape, token-exact against mlx-lm."""

from __future__ import annotations

import random

from harness import InProcessService
from model_factory import reference_greedy

from runtime.worker import compiled_decode as cd


def test_each_batch_shape_is_traced_once_and_tokens_stay_exact(model_dir, monkeypatch):
    """Trace count = distinct (rows, length bucket, compact) shapes, far fewer than steps: a
    step whose shapes or constants changed every time (a Python-int position, an exact length)
    would retrace every step and fail this."""
    traces = []
    forward = cd.CompiledDecode._forward

    def counted(self, tokens, rows, positions, keys, values, compact, length):
        traces.append((tokens.shape[0], length, compact))
        return forward(self, tokens, rows, positions, keys, values, compact, length)

    monkeypatch.setattr(cd.CompiledDecode, "_forward", counted)
    shapes, calls = set(), []
    call = cd.CompiledDecode.forward

    def spy(self, tokens, rows, positions, compact, length):
        shapes.add((tokens.shape[0], self.bucket(length), compact))
        calls.append(length)
        return call(self, tokens, rows, positions, compact, length)

    monkeypatch.setattr(cd.CompiledDecode, "forward", spy)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=4)
    assert svc.engine.compiled is not None and svc.engine.compiled.length_bucket == 32
    rng = random.Random(5)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(9 + 4 * i)], 40 - 8 * i) for i in range(3)]
    svc.run({0: reqs})
    assert len(calls) >= 38 and max(calls) > 32  # the run crossed a length bucket
    assert sorted(traces) == sorted(shapes), (traces, shapes)
    assert len(traces) <= len(calls) // 4
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_compiled_decode_is_off_for_hybrid_models(model_dir):
    """Recurrent layers keep their per-request state outside the row cache: the traced path does not apply."""
    svc = InProcessService(model_dir("qwen3_next"), max_running=2, aux_slots=8)
    assert svc.engine.compiled is None


def test_warm_up_traces_every_one_row_length(model_dir, monkeypatch):
    """After start-up, a lone request's decode never waits for a trace, however long it runs."""
    traces = []
    forward = cd.CompiledDecode._forward

    def counted(self, tokens, rows, positions, keys, values, compact, length):
        traces.append((tokens.shape[0], length, compact))
        return forward(self, tokens, rows, positions, keys, values, compact, length)

    monkeypatch.setattr(cd.CompiledDecode, "_forward", counted)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=2, max_context=160)
    svc.engine.warm_up()
    assert sorted(length for _, length, _ in traces if length) == [32, 64, 96, 128, 160]
    traces.clear()
    req = svc.request("long", [5, 9, 11, 40, 7], 120)
    svc.run({0: [req]})
    assert traces == []
    assert req.output_ids == reference_greedy(folder, req.prompt_ids, req.max_new)
