"""Sliding-window models on the paged-kernel decode path, token-exact against mlx-lm.

On a CUDA GPU a windowed model (Gemma 3, Cohere 2, EXAONE 4) decodes through the paged kernel,
each windowed layer reading its last W positions through a narrowed table (``window_view``).
Here the kernels are replaced by their reference computations (``_reference_kernels``), so the
whole path (device table, decode tail and its flushes, window views, compiled step) runs on the
CPU: generations past the window and crossing it, batched, with prefix hits longer than it.
gpt-oss adds attention sinks: the kernels' sink variant.
"""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from near_tie import assert_requests_like_mlx
from test_paged_attention import _reference_kernels
from test_windowed_families_exact import (  # noqa: F401 (folders: the fixture)
    WINDOW,
    _ids,
    check_prefix_hits_past_the_window,
    folders,
)

from runtime.worker.paths.cuda.decode_tail import tail_capacity

TAIL_STEPS = 2  # the decode tail of a lone row then holds 8 positions: the window's


def _kernel_paths(monkeypatch, tail_steps: int = TAIL_STEPS) -> None:
    from runtime.worker.paths import attention_paths

    _reference_kernels(monkeypatch)
    monkeypatch.setattr(attention_paths, "TAIL_STEPS", tail_steps)


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
@pytest.mark.parametrize("arch", ["gemma3_text", "cohere2", "exaone4"])
def test_windowed_layers_decode_through_the_kernel(arch, compiled, folders, monkeypatch):
    _kernel_paths(monkeypatch)
    assert tail_capacity(TAIL_STEPS) == WINDOW
    folder = folders(arch)
    views = []
    from runtime.worker.paths.cuda import window_view

    original = window_view.window_view

    def counted(*args):
        views.append(args[-1])
        return original(*args)

    monkeypatch.setattr(window_view, "window_view", counted)  # what both decode paths' views call
    svc = InProcessService(folder, max_running=8, row_cache=False, compile_decode=compiled)
    engine = svc.engine
    assert engine.paths.device_table is not None and engine.paths.tail is not None  # the kernel path
    assert (engine.compiled_paged is not None) == compiled and not engine.fuse_prefill
    views.clear()  # (the start-up warm-up's)
    rng = random.Random(3)
    # Past the window from the prompt on, and (the last two) crossing it while decoding.
    reqs = [svc.request(f"r{i}", _ids(rng, n), 14) for i, n in enumerate([20, 27, 34, WINDOW - 3, WINDOW + 4])]
    svc.run({0: reqs[:4], 2: reqs[4:]})
    assert_requests_like_mlx(folder, reqs)
    assert views and set(views) == {WINDOW}  # every windowed layer read through a view
    check_prefix_hits_past_the_window(svc, folder, rng)


def test_a_window_narrower_than_the_tail_keeps_the_masked_paths(folders, monkeypatch):
    _kernel_paths(monkeypatch, tail_steps=3)  # a lone row's tail would hold 12 positions: past the window
    svc = InProcessService(folders("gemma3_text"), max_running=8, row_cache=False)
    assert svc.engine.paths.attention is None and svc.engine.paths.device_table is None


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "eager"])
def test_attention_sinks_decode_through_the_kernels_sink_variant(compiled, folders, monkeypatch):
    """gpt-oss: window and full layers, a sink logit per query head in every attention."""
    _kernel_paths(monkeypatch)
    sinks_seen = []
    from runtime.worker.paths.paged_attention import PagedAttention

    append = PagedAttention._append_attend
    monkeypatch.setattr(PagedAttention, "_append_attend", lambda self, inputs, scale, launch, rope=None, sinks=None:
                        sinks_seen.append(sinks is not None) or append(self, inputs, scale, launch, rope, sinks))
    folder = folders("gpt_oss")
    svc = InProcessService(folder, max_running=8, row_cache=False, compile_decode=compiled)
    engine = svc.engine
    assert engine.paths.device_table is not None and engine.paths.sinks and not engine.fuse_prefill
    assert engine.paths.rope is None  # the rotating kernels have no sink variant: the model rotates
    sinks_seen.clear()
    rng = random.Random(4)
    reqs = [svc.request(f"r{i}", _ids(rng, n), 14) for i, n in enumerate([20, 27, WINDOW - 3, WINDOW + 4])]
    svc.run({0: reqs[:3], 2: reqs[3:]})
    assert_requests_like_mlx(folder, reqs)
    assert sinks_seen and all(sinks_seen)
    check_prefix_hits_past_the_window(svc, folder, rng)


def test_padded_prefill_keys_keep_each_layers_window(folders, monkeypatch):
    """With shapes padded (a GPU's default), a prefill chunk past position 0 gathers keys padded
    at the front: its windowed layers' masks must hide both the padding and what lies outside
    their window."""
    _kernel_paths(monkeypatch)
    from runtime.worker.paths import pool_cache

    windowed_masks = []
    original = pool_cache.front_padded_mask
    monkeypatch.setattr(pool_cache, "front_padded_mask",
                        lambda *args: windowed_masks.append(args) or original(*args))
    folder = folders("gemma3_text")
    svc = InProcessService(folder, max_running=8, row_cache=False, pad_shapes=True, prefill_chunk=WINDOW,
                           max_step_tokens=2 * WINDOW)
    rng = random.Random(5)
    reqs = [svc.request(f"c{i}", _ids(rng, 19 + 6 * i), 10) for i in range(3)]
    svc.run({0: reqs[:1], 1: reqs[1:]})
    assert_requests_like_mlx(folder, reqs)
    shared = list(reqs[0].prompt_ids)
    hits = [svc.request(f"h{i}", shared[: 5 + 6 * i] + _ids(rng, 5), 8) for i in range(3)]
    svc.run({0: hits})
    assert [r.prefix_len for r in hits] == [5, 11, 17]
    assert_requests_like_mlx(folder, hits)
    # Chunks past position 0 attended to keys padded at the front; a windowed layer's, where the
    # window reaches back past the chunk's start (the hit at 5), masked to the window (start,
    # queries, keys, rank, window). (Further on it reads its window alone, unpadded.)
    assert any(a[2] > a[0] + a[1] and a[4] == WINDOW for a in windowed_masks), windowed_masks


@pytest.mark.parametrize("pad", [True, False], ids=["padded-keys", "exact-keys"])
def test_a_kernel_path_prefill_chunk_reads_a_windowed_layers_window_only(pad, folders, monkeypatch):
    """On the kernel path (a GPU's default) a prefill chunk past position 0 gathers its keys from
    the pool, padded at the front where shapes are padded: once the window lies behind the chunk
    a windowed layer gathers W - 1 positions and the chunk (no front padding, no older prefix),
    the full layers whole (padded) prefixes; tokens stay mlx-lm's."""
    _kernel_paths(monkeypatch)
    from runtime.worker.pools.kv_pool import KVPool

    widths = []  # (KV layer, positions gathered)
    gather = KVPool.gather
    monkeypatch.setattr(KVPool, "gather", lambda self, layer, index: widths.append((layer, index.shape[1]))
                        or gather(self, layer, index))
    folder = folders("gpt_oss")  # windows on layers 0 and 2
    chunk = 16 if pad else 5  # a padded continuation's queries are at least 16
    svc = InProcessService(folder, max_running=4, row_cache=False, pad_shapes=pad, prefill_chunk=chunk,
                           max_step_tokens=chunk)
    assert svc.engine.paths.attention is not None and not svc.engine.fuse_prefill
    widths.clear()  # (the start-up warm-up's)
    rng = random.Random(9)
    reqs = [svc.request(f"r{i}", _ids(rng, n), 6) for i, n in enumerate([61, 37])]
    svc.run({0: reqs})
    assert_requests_like_mlx(folder, reqs)
    windowed = [w for layer, w in widths if layer in (0, 2)]
    full = [w for layer, w in widths if layer in (1, 3)]
    assert windowed and max(windowed) == chunk + WINDOW - 1, sorted(set(windowed))
    assert max(full) >= 48  # a full layer's prefix (past the third chunk)
