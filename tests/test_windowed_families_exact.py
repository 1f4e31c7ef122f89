"""Sliding-window families beyond Gemma 3, token-exact against mlx-lm.

gpt-oss alternates window and full layers, and every attention adds a learned per-head sink
logit (``sinks=`` in mlx-lm's attention call, passed through unchanged to MLX's attention);
Cohere 2 and EXAONE 4 have three window layers with RoPE, then a global layer without any
positional encoding. Prompts longer than the window, a short one whose generation crosses it,
chunked prefill past it, and prefix-cache hits longer than it (one a whole-prompt hit), on the
CPU paths (``test_sliding_window_exact`` covers every path's window masks with Gemma 3).
"""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from harness import InProcessService
from model_factory import load_cached, make_model
from near_tie import assert_requests_like_mlx

from runtime.worker.model.discovery import discover

WINDOW = 8
FAMILIES = {"gpt_oss": (WINDOW, None, WINDOW, None), "cohere2": (WINDOW, WINDOW, WINDOW, None),
            "exaone4": (WINDOW, WINDOW, WINDOW, None)}  # each family's per-layer windows
PATHS = {"compiled": dict(compile_decode=True), "eager": dict(compile_decode=False),
         "pool-gather": dict(compile_decode=False, row_cache=False)}
CASES = [("gpt_oss", path) for path in PATHS] + [(arch, path) for arch in ("cohere2", "exaone4")
                                                  for path in ("compiled", "pool-gather")]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    built: dict[str, object] = {}

    def get(arch: str):
        if arch not in built:
            built[arch] = make_model(arch, tmp_path_factory.mktemp(arch), sliding_window=WINDOW)
        return built[arch]

    return get


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(3, 250) for _ in range(n)]


def check_prefix_hits_past_the_window(svc: InProcessService, folder, rng: random.Random) -> None:
    """Prefix hits longer than the window (one a whole-prompt hit), token-exact."""
    shared = _ids(rng, 3 * WINDOW)
    first = [svc.request(f"a{i}", shared + _ids(rng, 2 + i), 10) for i in range(2)]
    svc.run({0: first})
    second = [svc.request(f"b{i}", shared[: 12 + 5 * i] + _ids(rng, 3), 11) for i in range(3)]
    repeat = svc.request("repeat", list(first[0].prompt_ids), 9)
    svc.run({0: second + [repeat]})
    assert [r.prefix_len for r in second] == [12, 17, 22] and repeat.prefix_len == len(repeat.prompt_ids) - 1
    assert_requests_like_mlx(folder, first + second + [repeat])



@pytest.mark.parametrize("arch", sorted(FAMILIES))
def test_discovery_records_each_layers_window(arch, folders):
    model, _ = load_cached(folders(arch))
    layout = discover(model)
    assert layout.windows == FAMILIES[arch]
    assert layout.routed and layout.sinks == (arch == "gpt_oss")
    if arch == "gpt_oss":  # the sinks this test relies on are drawn, not mlx-lm's zeros
        assert mx.any(model.layers[0].self_attn.sinks != 0).item()


@pytest.mark.parametrize("arch, path", CASES)
def test_windows_in_decode_chunked_prefill_and_prefix_hits(arch, path, folders):
    folder = folders(arch)
    svc = InProcessService(folder, max_running=8, **PATHS[path])
    assert svc.engine.paths.attention is None  # no paged decode for a windowed model
    if mx.default_device().type == mx.DeviceType.cpu:  # compiled decode is the CPU's
        assert (svc.engine.compiled is not None) == (path == "compiled")
    rng = random.Random(2)
    # Past the window from the prompt on, and (the last two) crossing it while decoding.
    reqs = [svc.request(f"r{i}", _ids(rng, n), 14) for i, n in enumerate([20, 27, 34, WINDOW - 3, WINDOW + 4])]
    svc.run({0: reqs[:4], 2: reqs[4:]})
    assert_requests_like_mlx(folder, reqs)
    check_prefix_hits_past_the_window(svc, folder, rng)
    chunked = InProcessService(folder, max_running=8, prefill_chunk=WINDOW, max_step_tokens=WINDOW, **PATHS[path])
    reqs = [chunked.request(f"c{i}", _ids(rng, 20 + 7 * i), 10) for i in range(3)]
    chunked.run({0: reqs})
    assert_requests_like_mlx(folder, reqs)


def test_the_pool_gather_reads_a_windowed_layers_window_only(folders, monkeypatch):
    """A pool-gather decode gathers W positions for a sliding-window layer, not the whole length."""
    from runtime.worker.pools.kv_pool import KVPool

    widths = []
    gather = KVPool.gather
    monkeypatch.setattr(KVPool, "gather", lambda self, layer, index: widths.append(index.shape[1])
                        or gather(self, layer, index))
    folder = folders("gpt_oss")
    svc = InProcessService(folder, max_running=8, **PATHS["pool-gather"])
    rng = random.Random(5)
    reqs = [svc.request(f"r{i}", _ids(rng, n), 12) for i, n in enumerate([30, 3, 17])]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    assert_requests_like_mlx(folder, reqs)
    assert widths.count(WINDOW) == widths.count(svc.engine.LENGTH_BUCKET) > 0  # one window layer per full one


def test_the_eager_row_cache_reads_a_windowed_layers_window_only(folders, monkeypatch):
    """An uncompiled row-cache decode (Metal's, and a GPU's with unpadded shapes) gathers each
    row's W positions out of the row cache for a sliding-window layer, not the whole length."""
    from runtime.worker.paths.rows.row_cache import RowSpan

    widths = []  # (window layer?, positions read) per decode-layer read
    write = RowSpan.write

    def spy(self, layer, keys, values, window_columns=None, first=0):
        out = write(self, layer, keys, values, window_columns, first)
        if self.decode:
            widths.append((window_columns is not None, out[0].shape[2], out[1].shape[2]))
        return out

    monkeypatch.setattr(RowSpan, "write", spy)
    folder = folders("gpt_oss")
    svc = InProcessService(folder, max_running=8, **PATHS["eager"])
    assert svc.engine.compiled is None and svc.engine.paths.row_cache is not None
    rng = random.Random(6)
    reqs = [svc.request(f"r{i}", _ids(rng, n), 12) for i, n in enumerate([30, 3, 17])]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    assert_requests_like_mlx(folder, reqs)
    windowed = [(k, v) for narrowed, k, v in widths if narrowed]
    assert windowed and all(k == v == WINDOW for k, v in windowed)
    assert len(windowed) == sum(1 for narrowed, _, _ in widths if not narrowed)  # one window layer per full one


@pytest.mark.parametrize("path", ["compiled", "eager"])
def test_a_row_cache_prefill_chunk_reads_a_windowed_layers_window_only(path, folders, monkeypatch):
    """Past position 0 a prefill chunk's sliding-window layers read their last W - 1 positions
    of prefix and the chunk (what mlx-lm's RotatingKVCache holds), not the whole prefix; full
    layers read it all. Token-exact, chunks of 5 crossing the window of 8 several times."""
    from runtime.worker.paths.rows.row_cache import RowSpan

    reads = []  # (chunk start, chunk length, first position read, positions read) of windowed layers
    write = RowSpan.write

    def spy(self, layer, keys, values, window_columns=None, first=0):
        out = write(self, layer, keys, values, window_columns, first)
        if not self.decode and out is not None:
            reads.append((self.start, keys.shape[2], first, out[0].shape[2]))
        return out

    monkeypatch.setattr(RowSpan, "write", spy)
    folder = folders("gpt_oss")  # windows in layers 0 and 2
    svc = InProcessService(folder, max_running=4, prefill_chunk=5, max_step_tokens=5, **PATHS[path])
    rng = random.Random(9)
    reqs = [svc.request(f"r{i}", _ids(rng, n), 6) for i, n in enumerate([37, 23])]
    svc.run({0: reqs})
    assert_requests_like_mlx(folder, reqs)
    narrowed = [(s, n, f, k) for s, n, f, k in reads if f > 0]
    assert narrowed and all(f == s - WINDOW + 1 and k == n + WINDOW - 1 for s, n, f, k in narrowed), narrowed
    whole = [(s, n, k) for s, n, f, k in reads if f == 0 and s >= WINDOW]
    assert whole and all(k == s + n for s, n, k in whole)  # the full layers
    assert len(narrowed) == len(whole)  # one windowed layer per full one


def test_a_pool_gather_prefill_chunk_reads_a_windowed_layers_window_only(folders, monkeypatch):
    """The same where chunks gather their keys from the pool (a CPU whose row cache would not
    fit, Metal at a GPU's sizing): a windowed layer (0 and 2 of gpt-oss) never gathers more
    than a chunk and W - 1 positions before it, while the full layers gather whole prefixes."""
    from runtime.worker.pools.kv_pool import KVPool

    widths = []  # (KV layer, positions gathered)
    gather = KVPool.gather
    monkeypatch.setattr(KVPool, "gather", lambda self, layer, index: widths.append((layer, index.shape[1]))
                        or gather(self, layer, index))
    folder = folders("gpt_oss")
    svc = InProcessService(folder, max_running=4, prefill_chunk=5, max_step_tokens=5, **PATHS["pool-gather"])
    rng = random.Random(9)
    reqs = [svc.request(f"r{i}", _ids(rng, n), 6) for i, n in enumerate([37, 23])]
    svc.run({0: reqs})
    assert_requests_like_mlx(folder, reqs)
    windowed = [w for layer, w in widths if layer in (0, 2)]
    assert windowed and max(windowed) == 5 + WINDOW - 1
    assert max(w for layer, w in widths if layer in (1, 3)) >= 35  # a full layer's prefix
