"""Sliding-window layers (mlx-lm's RotatingKVCache) token-exact against mlx-lm.

Gemma 3's local layers attend to the last ``sliding_window`` positions only. The runtime keeps
every position of every layer in the pool and masks the older ones out, per layer: prefill
with mlx-lm's causal-and-window mask, decode with each row's valid positions above
``position - window``. Prompts longer than the window, and generations crossing it, show a
missing or misplaced window (a full layer's mask on a local layer, or the reverse).
"""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from model_factory import KV_HEADS, load_cached, make_model, reference_greedy

from runtime.worker.model.discovery import discover

WINDOW = 8
BATCH_SIZES = sorted({1, 2, KV_HEADS, 5})


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_model("gemma3_text", tmp_path_factory.mktemp("gemma3_window"), sliding_window=WINDOW)


def _prompts(seed: int, n: int) -> list[list[int]]:
    """Prompts of 20..40 tokens (past the window), and one shorter than it when n > 1."""
    rng = random.Random(seed)
    lengths = [20 + (7 * i) % 21 for i in range(n)]
    if n > 1:
        lengths[-1] = WINDOW - 3  # its generation crosses the window during decode
    return [[rng.randrange(3, 250) for _ in range(length)] for length in lengths]


def test_discovery_records_each_layers_window(folder):
    model, _ = load_cached(folder)
    layout = discover(model)
    # Layers 0 and 2 are local (RotatingKVCache), 1 and 3 global.
    assert layout.windows == (WINDOW, None, WINDOW, None)
    assert layout.windowed and layout.attention_layers == (0, 1, 2, 3)


@pytest.mark.parametrize("row_cache", [None, False], ids=["row-cache", "pool-gather"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("batch", BATCH_SIZES)
def test_batched_decode_past_the_window_is_exact(batch, compiled, row_cache, folder):
    svc = InProcessService(folder, max_running=8, compile_decode=compiled, row_cache=row_cache)
    assert (svc.engine.compiled is not None) == (compiled and row_cache is None)
    reqs = [svc.request(f"r{i}", p, 14) for i, p in enumerate(_prompts(batch, batch))]
    svc.run({0: reqs})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize("row_cache", [None, False], ids=["row-cache", "pool-gather"])
def test_chunked_prefill_past_the_window_is_exact(row_cache, folder):
    """Prefill chunks past position 0 attend to a prefix partly outside their window."""
    svc = InProcessService(folder, max_running=8, prefill_chunk=8, max_step_tokens=8, row_cache=row_cache)
    reqs = [svc.request(f"c{i}", p, 10) for i, p in enumerate(_prompts(77, 3))]
    svc.run({0: reqs})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize("row_cache", [None, False], ids=["row-cache", "pool-gather"])
@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_prefix_hits_past_the_window_are_exact(compiled, row_cache, folder):
    """Rows that share a cached prefix longer than the window (one a whole-prompt hit)."""
    svc = InProcessService(folder, max_running=8, compile_decode=compiled, row_cache=row_cache)
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(24)]
    first = [svc.request(f"a{i}", shared + [rng.randrange(3, 250) for _ in range(2 + i)], 10) for i in range(3)]
    svc.run({0: first})
    second = [svc.request(f"b{i}", shared[: 12 + 5 * i] + [rng.randrange(3, 250) for _ in range(3)], 11)
              for i in range(3)]
    repeat = svc.request("repeat", list(first[0].prompt_ids), 9)
    svc.run({0: second + [repeat]})
    assert all(r.prefix_len > WINDOW for r in second) and repeat.prefix_len == len(repeat.prompt_ids) - 1
    for r in first + second + [repeat]:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_windows_that_masking_cannot_reproduce_are_refused(folder):
    """Attention-sink positions (``keep``) and local layers of different windows."""
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    from runtime.worker.model.discovery import UnsupportedModel

    model, _ = load_cached(folder)
    made = model.make_cache
    try:
        model.make_cache = lambda: [RotatingKVCache(WINDOW, keep=4), KVCache(), RotatingKVCache(WINDOW), KVCache()]
        with pytest.raises(UnsupportedModel, match="keep=4"):
            discover(model)
        model.make_cache = lambda: [RotatingKVCache(WINDOW), KVCache(), RotatingKVCache(2 * WINDOW), KVCache()]
        with pytest.raises(UnsupportedModel, match="different windows"):
            discover(model)
    finally:
        model.make_cache = made


def test_the_compiled_step_reads_a_windowed_layers_window_only(folder, monkeypatch):
    """The CPU's compiled decode step has each sliding-window layer gather its rows' last WINDOW
    positions (``StepArrays.gathers``), not the whole length or a span that grows with how far
    apart the rows are, as mlx-lm's RotatingKVCache holds the window alone: one row, rows
    spread 88 positions apart, and scattered rows run padded."""
    from runtime.worker.paths.rows import row_view

    widths = []  # (attended length, positions a windowed layer read) per traced step
    fetch = row_view.RowView.update_and_fetch

    def spy(self, keys, values):
        out = fetch(self, keys, values)
        if self.window is not None:
            widths.append((self.step.length, out[0].shape[2], out[1].shape[2]))
        return out

    monkeypatch.setattr(row_view.RowView, "update_and_fetch", spy)
    svc = InProcessService(folder, max_running=8, compile_decode=True)
    assert svc.engine.compiled is not None and svc.engine.compiled.length_bucket == 32
    widths.clear()  # (the start-up traces')
    rng = random.Random(11)
    prompts = [[rng.randrange(3, 250) for _ in range(n)] for n in (70, 12, 100, 40, 75)]
    reqs = [svc.request(f"r{i}", p, 30) for i, p in enumerate(prompts)]
    svc.run({0: reqs[:1]})  # alone: one row
    svc.run({0: reqs[1:4], 6: reqs[4:]})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
    assert widths and max(length for length, _, _ in widths) >= 128  # traced past four buckets
    assert all(k == v == WINDOW for _, k, v in widths), widths
