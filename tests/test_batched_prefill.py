"""Prefill chunks of several requests run as one batched forward, token-exact against mlx-lm."""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from model_factory import reference_greedy


@pytest.fixture(params=["llama", "qwen3"])
def folder(request, model_dir):
    return model_dir(request.param)


def _spy_groups(svc: InProcessService) -> list[tuple[int, int, int]]:
    """(start, rows, distinct chunk lengths) of every batched prefill the engine runs."""
    groups: list[tuple[int, int, int]] = []
    batch = svc.engine._prefill_batch

    def spy(group):
        groups.append((group[0].start, len(group), len({len(c.token_ids) for c in group})))
        return batch(group)

    svc.engine._prefill_batch = spy
    return groups


def test_chunks_of_one_start_are_batched_and_exact(folder):
    svc = InProcessService(folder, max_step_tokens=512)
    svc.engine.max_padding = 0.25  # the GPU policy: some padding to batch more
    groups = _spy_groups(svc)
    rng = random.Random(3)
    # Distinct first tokens: no prompt may hit another's prefix.
    same = [svc.request(f"s{i}", [10 + i] + [rng.randrange(3, 250) for _ in range(30)], 10) for i in range(6)]
    other = [svc.request(f"o{i}", [20 + i] + [rng.randrange(3, 250) for _ in range(16 + 9 * i)], 10) for i in range(2)]
    svc.run({0: same + other})
    assert (0, 6, 1) in groups and any(start == 0 and lengths == 2 for start, _, lengths in groups), groups
    for r in same + other:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, 10), r.rid


def test_batched_chunks_after_a_prefix_hit_are_exact(folder):
    svc = InProcessService(folder, max_step_tokens=512)
    svc.engine.max_padding = 0.25
    groups = _spy_groups(svc)
    rng = random.Random(4)
    shared = [rng.randrange(3, 250) for _ in range(40)]
    seed = svc.request("seed", shared + [5, 6, 7], 6)
    svc.run({0: [seed]})
    hits = [svc.request(f"h{i}", shared + [30 + i] + [rng.randrange(3, 250) for _ in range(8 + 3 * (i % 2))], 8)
            for i in range(4)]
    svc.run({0: hits})
    assert all(r.prefix_len == 40 for r in hits)
    assert (40, 4, 2) in groups, groups  # two suffix lengths, padded into one batch
    for r in [seed] + hits:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def _chunk(row: int, start: int, n: int):
    from runtime.protocol.worker import PrefillChunk

    return PrefillChunk(row, start, [1] * n, list(range(n)))


def test_prefill_groups_policy():
    from runtime.worker.paths.prefill_groups import prefill_groups

    def shape(groups):
        return [[(c.row, c.start, len(c.token_ids)) for c in g] for g in groups]

    chunks = [_chunk(0, 0, 30), _chunk(1, 0, 16), _chunk(2, 0, 25), _chunk(3, 0, 30)]
    # Equal lengths only, sorted by length within the run.
    assert shape(prefill_groups(chunks, True, 0.0)) == [[(1, 0, 16)], [(2, 0, 25)], [(0, 0, 30), (3, 0, 30)]]
    # A quarter of padding lets 25 and 30 share a batch (16 would need more).
    assert shape(prefill_groups(chunks, True, 0.25)) == [[(1, 0, 16), (2, 0, 25)], [(0, 0, 30), (3, 0, 30)]]
    # A row's second chunk, another start, and models with recurrent state never join a batch.
    mixed = [_chunk(0, 0, 8), _chunk(0, 8, 8), _chunk(1, 8, 8)]
    assert shape(prefill_groups(mixed, True, 0.0)) == [[(0, 0, 8)], [(0, 8, 8), (1, 8, 8)]]
    assert len(prefill_groups(chunks, False, 0.25)) == 4


@pytest.mark.parametrize("arch", ["qwen3_next", "mamba2"])
def test_hybrid_chunks_are_batched_with_their_states(arch, model_dir):
    """Recurrent-state models batch equal chunks: fresh states together, saved states
    together, each row's state and tracked snapshot stored to its own slots."""
    folder = model_dir(arch)
    svc = InProcessService(folder, aux_slots=64, track_chunk=8, max_step_tokens=512)
    groups = _spy_groups(svc)
    rng = random.Random(21)
    shared = [rng.randrange(3, 250) for _ in range(16)]
    wave = [svc.request(f"w{i}", [60 + i] + [rng.randrange(3, 250) for _ in range(20)], 6) for i in range(5)]
    seed = svc.request("seed", shared + [5, 6, 7, 8, 9], 4)
    svc.run({0: wave + [seed]})
    hits = [svc.request(f"h{i}", shared + [70 + i] + [rng.randrange(3, 250) for _ in range(4)], 6) for i in range(4)]
    svc.run({0: hits})
    assert all(r.prefix_len == 16 for r in hits), [r.prefix_len for r in hits]
    assert any(start == 0 and rows >= 5 for start, rows, _ in groups), groups  # fresh states
    assert any(start == 16 and rows >= 4 for start, rows, _ in groups), groups  # restored states
    for r in wave + [seed] + hits:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_prefill_groups_run_dependencies_first():
    from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH, PrefillChunk
    from runtime.worker.paths.prefill_groups import prefill_groups

    a0, a8, b8, c0 = _chunk(0, 0, 8), _chunk(0, 8, 8), _chunk(1, 8, 8), _chunk(2, 0, 8)
    # b8 reads the prefix a0 writes; c0 may run alongside a0.
    groups = prefill_groups([a0, a8, b8, c0], True, 0.0)
    assert [[(c.row, c.start) for c in g] for g in groups] == [[(0, 0), (2, 0)], [(0, 8), (1, 8)]]
    fresh = PrefillChunk(3, 8, [1] * 8, list(range(8)), aux_slot=1, aux_source=AUX_FRESH)
    saved = PrefillChunk(4, 8, [1] * 8, list(range(8)), aux_slot=2, aux_source=AUX_CONTINUE)
    groups = prefill_groups([fresh, saved], True, 0.25, recurrent=True)
    assert [[c.row for c in g] for g in groups] == [[3], [4]]  # empty and saved states never share a batch


def test_prefill_lengths_recur():
    from runtime.worker.paths.prefill_shapes import prefill_length

    assert [prefill_length(n) for n in (1, 16, 17, 128, 129, 300, 513, 2047, 2048)] == [
        16, 16, 32, 128, 144, 320, 576, 2048, 2048]
    lengths = {prefill_length(n) for n in range(1, 2049)}
    assert len(lengths) == 40 and all(prefill_length(n) >= n for n in range(1, 5000))
    assert all(prefill_length(n) <= n * 1.125 for n in range(128, 5000))


def test_padded_shapes_are_exact(folder):
    """The GPU's prefill shapes on the generic path: rows rounded to a power of two, and past
    a cached prefix the gathered keys rounded up, padded at the front and masked."""
    svc = InProcessService(folder, max_step_tokens=512, row_cache=False)
    svc.engine.max_padding = 0.25
    rng = random.Random(6)
    shared = [rng.randrange(3, 250) for _ in range(37)]
    seed = svc.request("seed", shared + [5, 6, 7], 6)
    svc.run({0: [seed]})
    hits = [svc.request(f"h{i}", shared + [30 + i] + [rng.randrange(3, 250) for _ in range(8 + 3 * (i % 2))], 8)
            for i in range(3)]
    svc.run({0: hits})
    assert all(r.prefix_len == 37 for r in hits)
    # Three suffixes of up to 12 tokens at 37: 4 rows (one padding row) of 16 queries, 256 keys.
    assert (4, 16, 256) in svc.engine.prefill_shapes, svc.engine.prefill_shapes
    for r in [seed] + hits:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def _serves_exactly_after_warm_up(svc: InProcessService, folder, seed: int, first: int, base: int, step: int,
                                  new: int) -> None:
    """Three prompts of different lengths (distinct first tokens: no prefix hits) through the warmed
    service, each token-exact against mlx-lm: the warm-up left nothing behind that a request reads."""
    rng = random.Random(seed)
    reqs = [svc.request(f"w{i}", [first + i] + [rng.randrange(3, 250) for _ in range(base + step * i)], new)
            for i in range(3)]
    svc.run({0: reqs})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, new), r.rid


def test_prefill_warm_up_runs_the_common_shapes_and_leaves_the_service_exact(folder):
    from runtime.worker.paths.prefill_warmup import common_shapes, warm_prefill

    svc = InProcessService(folder, max_step_tokens=64, prefill_chunk=32, max_running=8, row_cache=False)
    assert warm_prefill(svc.engine, 64, 32) == 0  # no padding policy (the CPU's): nothing to warm
    svc.engine.max_padding = 0.25
    shapes = list(common_shapes(64, 32, 8, 512))
    assert shapes[:4] == [(1, 16, 0), (1, 32, 0), (1, 48, 0), (1, 64, 0)]
    assert (4, 16, 0) in shapes and (8, 16, 0) not in shapes
    assert (1, 16, 240) in shapes and (1, 32, 480) in shapes  # past position 0: 256 and 512 keys
    assert (2, 32, 480) in shapes and (4, 16, 496) in shapes and (8, 16, 240) not in shapes  # 2 and 4 rows of them
    assert warm_prefill(svc.engine, 64, 32) == len(shapes)
    assert {(r, n, start + n) for r, n, start in shapes} <= svc.engine.prefill_shapes
    _serves_exactly_after_warm_up(svc, folder, seed=8, first=40, base=20, step=7, new=8)


def test_prefill_warm_up_skips_the_shapes_a_small_pool_cannot_hold(folder):
    """Rows past position 0 share the prefix's slots and take their own after it: a shape
    needs start + rows * length slots (slot 0 is padding), and those that need more are left out."""
    from runtime.worker.paths.prefill_warmup import common_shapes, warm_prefill

    svc = InProcessService(folder, max_step_tokens=64, prefill_chunk=32, max_running=8, row_cache=False,
                           kv_slots=520)
    svc.engine.max_padding = 0.25
    slots = svc.engine.pool.num_slots
    shapes = list(common_shapes(64, 32, 8, min(512, slots - 1)))
    fit = [(r, n, start) for r, n, start in shapes if start + r * n < slots]
    assert (2, 16, 496) in shapes and (2, 16, 496) not in fit and (1, 32, 480) in fit
    assert warm_prefill(svc.engine, 64, 32) == len(fit)
    assert {(r, n, start + n) for r, n, start in fit} <= svc.engine.prefill_shapes
    _serves_exactly_after_warm_up(svc, folder, seed=10, first=60, base=18, step=5, new=6)


def test_prefill_warm_up_runs_one_layer_where_layers_are_alike_and_stays_exact(folder, monkeypatch):
    from runtime.worker.model.discovery import layers_owner
    from runtime.worker.paths import prefill_warmup

    svc = InProcessService(folder, max_step_tokens=64, prefill_chunk=32, max_running=8, row_cache=False)
    svc.engine.max_padding = 0.25
    layers = layers_owner(svc.engine.model)["layers"]
    seen = []
    launch = svc.engine.launch
    monkeypatch.setattr(svc.engine, "launch", lambda step: seen.append(
        len(layers_owner(svc.engine.model)["layers"])) or launch(step))
    shapes = list(prefill_warmup.common_shapes(64, 32, 8, 512))
    assert prefill_warmup.warm_prefill(svc.engine, 64, 32) == len(shapes)
    assert seen == [1] * len(shapes) and len(layers) > 1  # every warm-up forward through the first layer
    assert layers_owner(svc.engine.model)["layers"] is layers  # the model whole again
    monkeypatch.undo()
    _serves_exactly_after_warm_up(svc, folder, seed=9, first=50, base=24, step=9, new=8)


def test_layers_that_differ_keep_the_whole_model_in_the_warm_up(model_dir):
    from runtime.worker.model.discovery import layers_owner
    from runtime.worker.paths import warmup_layers

    svc = InProcessService(model_dir("gemma3_text"), max_running=2, row_cache=False)
    assert not warmup_layers.alike_layers(svc.engine.layout)  # sliding and global layers
    with warmup_layers.leading_layers_only(svc.engine.model, svc.engine.layout) as kept:
        assert kept == 0
        assert len(layers_owner(svc.engine.model)["layers"]) == svc.engine.layout.num_layers
