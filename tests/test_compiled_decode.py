"""The compiled row-cache decode: traced once per batch shape, token-exact against mlx-lm."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from harness import InProcessService
from model_factory import reference_greedy

from runtime.worker.paths.rows import compiled_decode as cd
from runtime.worker.paths.rows import row_attention as ra


def test_each_batch_shape_is_traced_once_and_tokens_stay_exact(model_dir, monkeypatch):
    """Trace count = distinct (rows, length bucket, compact) shapes, far fewer than steps: a
    step whose shapes or constants changed every time (a Python-int position, an exact length)
    would retrace every step and fail this."""
    traces = []
    forward = cd.CompiledDecode._forward

    def counted(self, tokens, rows, positions, keys, values, compact, length, *aux):
        traces.append((tokens.shape[0], length, compact))
        return forward(self, tokens, rows, positions, keys, values, compact, length, *aux)

    monkeypatch.setattr(cd.CompiledDecode, "_forward", counted)
    shapes, calls = set(), []
    call = cd.CompiledDecode.forward

    def spy(self, tokens, rows, positions, compact, length, *aux, **kw):
        shapes.add((tokens.shape[0], self.bucket(length), compact))
        calls.append(length)
        return call(self, tokens, rows, positions, compact, length, *aux, **kw)

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


@pytest.mark.parametrize("arch", ["qwen3_next", "qwen3_5"])
def test_hybrid_models_decode_compiled_with_their_recurrent_state(arch, model_dir, monkeypatch):
    """Gated delta-net layers read their rows' state from the aux pool inside the traced step
    and write it back; rows joining and leaving move the slots. Tokens stay exact."""
    steps = []
    forward = cd.CompiledDecode.forward

    def spy(self, tokens, rows, positions, compact, length, aux_slots=None):
        steps.append(aux_slots is not None)
        return forward(self, tokens, rows, positions, compact, length, aux_slots)

    monkeypatch.setattr(cd.CompiledDecode, "forward", spy)
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=3, aux_slots=32)
    assert svc.engine.compiled is not None and svc.engine.compiled.aux_pool is svc.engine.aux_pool
    rng = random.Random(4)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(4 + 9 * i)], 6 + 5 * i) for i in range(4)]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    assert steps and all(steps)
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_models_without_attention_are_not_compiled(model_dir):
    svc = InProcessService(model_dir("mamba2"), max_running=2, aux_slots=8)
    assert svc.engine.compiled is None


@pytest.mark.parametrize("n_heads, n_kv_heads, head_dim", [(4, 2, 64), (8, 2, 32), (4, 4, 16), (6, 2, 128)])
def test_folded_attention_equals_mlx_attention_bit_for_bit(n_heads, n_kv_heads, head_dim):
    """With MLX's bundled BLAS (this test process; the worker may preload another) folding the
    query heads changes no bit, masked rows and sliced keys included."""
    lengths = [32, 96, 416]
    assert ra.folded_attention_is_exact(n_heads, n_kv_heads, head_dim, mx.float32, lengths)
    q = mx.random.normal((3, n_heads, 1, head_dim), key=mx.random.key(4))
    k = mx.random.normal((3, n_kv_heads, 100, head_dim), key=mx.random.key(5))
    v = mx.random.normal((3, n_kv_heads, 100, head_dim), key=mx.random.key(6))
    mask = (mx.arange(64)[None, :] <= mx.array([63, 10, 40])[:, None])[:, None, None, :]
    folded = ra.folded_attention(q, k[:, :, :64], v[:, :, :64], 0.3, mask)
    assert folded.shape == (3, n_heads, 1, head_dim)
    assert mx.array_equal(folded, mx.fast.scaled_dot_product_attention(q, k[:, :, :64], v[:, :, :64], scale=0.3,
                                                                     mask=mask))


def test_folding_is_off_where_it_would_change_a_bit(monkeypatch):
    exact = ra.folded_attention

    def off_by_an_ulp(q, k, v, scale, mask):
        out = exact(q, k, v, scale, mask)
        return out * (1 + 2**-20)

    monkeypatch.setattr(ra, "folded_attention", off_by_an_ulp)
    assert not ra.folded_attention_is_exact(4, 2, 64, mx.float32, [32, 64])


def test_compiled_decode_attends_through_the_folded_heads(model_dir, monkeypatch):
    calls = []
    folded = ra.folded_attention

    def spy(q, k, v, scale, mask):
        calls.append(q.shape)
        return folded(q, k, v, scale, mask)

    monkeypatch.setattr(ra, "folded_attention", spy)
    folder = model_dir("qwen3")
    svc = InProcessService(folder, max_running=2)
    assert svc.engine.compiled is not None and svc.engine.compiled.fold_heads
    calls.clear()  # the start-up exactness check calls it too
    rng = random.Random(2)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(6 + 9 * i)], 12) for i in range(2)]
    svc.run({0: reqs})
    assert calls and all(shape[2] == 1 for shape in calls)
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_trace_cache_keeps_the_most_recent_shapes_only():
    from runtime.worker.paths.trace_cache import TraceCache

    traced = []

    def double(x):
        traced.append(x.shape)  # runs only while tracing
        return x * 2

    cache = TraceCache(double, capacity=2)
    a, b, c = mx.ones((1,)), mx.ones((2,)), mx.ones((3,))
    assert cache("a", a).tolist() == [2.0]
    cache("b", b)
    cache("a", a)  # a is the most recent again
    cache("c", c)  # drops b
    assert len(cache) == 2 and len(traced) == 3
    cache("a", a)
    assert len(traced) == 3  # still cached
    cache("b", b)
    assert len(traced) == 4  # traced again


def test_a_full_trace_cache_keeps_decode_exact(model_dir, monkeypatch):
    """With room for two shapes, steps keep evicting and retracing; tokens must not change."""
    monkeypatch.setattr(cd, "MAX_TRACES", 2)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=3)
    rng = random.Random(9)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(5 + 11 * i)], 30) for i in range(3)]
    svc.run({0: reqs[:1], 2: reqs[1:]})
    assert len(svc.engine.compiled.traces) <= 2
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_row_split_attention_is_bit_identical_to_one_stream():
    from runtime.worker.paths.rows.parallel_attention import RowSplit

    split = RowSplit(3)
    assert [split.parts(rows) for rows in (1, 4, 7, 8, 11, 12, 16, 64)] == [1, 1, 1, 2, 2, 3, 3, 3]
    kq, kk, kv = mx.random.split(mx.random.key(1), 3)
    rows, length = 13, 150
    queries = mx.random.normal((rows, 4, 1, 32), key=kq)
    keys = mx.random.normal((rows, 2, 200, 32), key=kk)[:, :, :length]  # a slice, as of the row cache
    values = mx.random.normal((rows, 2, 200, 32), key=kv)[:, :, :length]
    mask = (mx.arange(length)[None, :] <= mx.arange(100, 100 + rows)[:, None])[:, None, None, :]
    for attend in (ra.mlx_attention, ra.folded_attention):
        whole = attend(queries, keys, values, 0.25, mask)
        assert mx.array_equal(split.attend(attend, queries, keys, values, 0.25, mask, 3), whole).item()


@pytest.mark.parametrize("fold", [True, False], ids=["folded", "mlx-attention"])
def test_compiled_decode_splits_big_batches_over_cpu_streams(fold, model_dir, monkeypatch):
    from runtime.worker.paths.rows.parallel_attention import RowSplit

    parts = []
    attend = RowSplit.attend
    monkeypatch.setattr(RowSplit, "attend", lambda self, *a: parts.append(a[-1]) or attend(self, *a))
    if not fold:
        monkeypatch.setattr(cd, "folded_attention_is_exact", lambda *a: False)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=16, attention_streams=2)
    assert svc.engine.compiled is not None and svc.engine.compiled.fold_heads == fold
    rng = random.Random(4)
    # 11 rows at first (a batch of 16 rows: two groups), fewer as short requests finish.
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(5 + 3 * i)], 4 + 3 * (i % 4)) for i in range(11)]
    svc.run({0: reqs})
    assert parts and set(parts) == {2}
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_attention_threads_default_to_one_per_cpu_and_are_validated():
    from runtime.config import ConfigError, parse_config
    from runtime.worker.paths.rows.parallel_attention import (
        MAX_STREAMS,
        default_streams,
    )

    assert [default_streams(n) for n in (None, 1, 2, 3, 64)] == [1, 1, 2, 3, MAX_STREAMS]
    with pytest.raises(ConfigError, match="attention_threads"):
        parse_config({"model": {"path": "/m"}, "worker": {"attention_threads": -1}})
    assert parse_config({"model": {"path": "/m"}, "worker": {"attention_threads": 1}}).worker.attention_threads == 1


def test_a_gpu_never_splits_attention_over_cpu_streams(model_dir, monkeypatch):
    """The extra streams are CPU streams: on a GPU they would move most rows' attention onto
    host threads (session 33: 140 ms steps for Gemma 3 1B at 16 rows on an H100)."""
    import runtime.worker.engine as engine_module
    from runtime.worker.paths.rows.parallel_attention import streams_on

    assert streams_on(True, 3) == 3 and streams_on(False, 3) == 1 and streams_on(False, 1) == 1
    asked = []
    monkeypatch.setattr(engine_module, "streams_on",
                        lambda on_cpu, n: asked.append((on_cpu, n)) or streams_on(not on_cpu, n))
    svc = InProcessService(model_dir("llama"), max_running=16, attention_streams=2)
    assert asked == [(True, 2)]  # the engine asks with its device (the CPU here) ...
    assert svc.engine.compiled is not None and svc.engine.compiled.split is None  # ... and takes the answer
