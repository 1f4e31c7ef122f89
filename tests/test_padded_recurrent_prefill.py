"""A hybrid's prompts padded at the end (``worker.pad_shapes`` on; ``padding_probe``): the probe
that lets them, and tokens that stay mlx-lm's on the CPU, from empty states and from saved ones."""

from __future__ import annotations

import random

import mlx.core as mx
import pytest
from harness import InProcessService
from mlx_lm.utils import load_model
from model_factory import reference_greedy

from runtime.protocol.worker import AUX_FRESH, PrefillChunk
from runtime.worker.model.discovery import discover
from runtime.worker.model.padding_probe import pads_recurrent_exactly
from runtime.worker.paths.prefill_groups import prefill_groups
from runtime.worker.paths.prefill_shapes import prefill_length


def _probe(folder) -> bool:
    model = load_model(folder)[0]
    return pads_recurrent_exactly(model, discover(model))


@pytest.mark.parametrize(("arch", "pads"), [
    ("qwen3_next", True),  # delta-net layers that read ``cache.lengths``
    ("falcon_h1", True),   # a CacheList (Mamba state and KV cache) a layer
    ("mamba", False),      # its conv state takes the padding
    ("llama", False),      # nothing recurrent: nothing to decide
])
def test_the_probe_lets_only_models_whose_recurrent_layers_honour_the_lengths(model_dir, arch, pads):
    assert _probe(model_dir(arch)) is pads


def test_recurrent_groups_are_padded_only_where_the_model_allows_it():
    chunks = [PrefillChunk(row=i, start=0, token_ids=[1] * n, slot_ids=[0] * n, aux_slot=i + 1, aux_source=AUX_FRESH)
              for i, n in enumerate((30, 25))]

    def lengths(groups: list[list[PrefillChunk]]) -> list[list[int]]:
        return [[len(c.token_ids) for c in g] for g in groups]

    assert lengths(prefill_groups(chunks, True, 0.25, recurrent=True)) == [[25], [30]]
    assert lengths(prefill_groups(chunks, True, 0.25, recurrent=True, pads_recurrent=True)) == [[25, 30]]


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 200) for _ in range(n)]


@pytest.mark.parametrize(("arch", "row_cache"), [("qwen3_next", None), ("falcon_h1", None), ("qwen3_next", False)])
def test_padded_hybrid_prompts_keep_mlx_lms_tokens(model_dir, arch, row_cache):
    """``row_cache`` False (a GPU's paged path): row counts are padded to powers of two too, the
    padding rows running from empty (or the reserved slot's) states at length 0."""
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, aux_slots=64, track_chunk=16, prefill_chunk=48, pad_shapes=True,
                           row_cache=row_cache)
    assert svc.engine.pads_recurrent
    rng = random.Random(5)
    shared = _ids(rng, 40)
    # Together: prompts of several lengths (one forward, the shorter ones padded), from empty states.
    cold = [svc.request(f"c{i}", _ids(rng, n), 8) for i, n in enumerate((38, 21, 29, 12))]
    cold += [svc.request("s0", shared + _ids(rng, 3), 4)]
    svc.run({0: cold})
    # Then suffixes of several lengths on the cached prefix: padded, from the saved state at 32.
    warm = [svc.request(f"w{i}", shared + _ids(rng, n), 8) for i, n in enumerate((2, 9, 5))]
    svc.run({0: warm})
    assert [r.prefix_len for r in warm] == [32, 32, 32]
    # Prompts are cut at multiples of the tracking chunk (16); the rests (5, 4, 12, 11, 11 of the
    # first wave) were padded to 16 in one forward with the full chunks.
    queries = {n for _, n, _ in svc.engine.prefill_shapes}
    assert queries and all(n == prefill_length(n) for n in queries), queries
    rows = {r for r, _, _ in svc.engine.prefill_shapes}
    if row_cache is False:
        assert rows <= {1, 2, 4, 8} and rows & {2, 4, 8}, rows  # 3 or 5 rows ran as 4 or 8
    for r in cold + warm:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_a_model_the_probe_refuses_keeps_its_prompts_unpadded(model_dir):
    folder = model_dir("mamba")
    svc = InProcessService(folder, max_running=4, aux_slots=32, pad_shapes=True)
    assert not svc.engine.pads_recurrent
    reqs = [svc.request(f"r{i}", _ids(random.Random(i), n), 6) for i, n in enumerate((38, 21))]
    svc.run({0: reqs})
    assert {n for _, n, _ in svc.engine.prefill_shapes} == {37, 20}
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


@pytest.mark.parametrize(("layers", "interval", "leading"), [
    # a delta-net layer, an attention layer, and the next delta-net layer, whose input norm takes
    # the residual fused in (the first layer's does not); not the fourth
    (4, 2, 3),
    # the first period (three delta-net layers, one attention layer) of two: the second period's
    # delta-net layers are not run, so their states must come in to be written back
    (8, 4, 4),
])
def test_a_padded_hybrid_warms_its_prefill_shapes_and_stays_exact(tmp_path, monkeypatch, layers, interval, leading):
    from model_factory import make_model

    from runtime.worker.model.discovery import layers_owner
    from runtime.worker.paths.prefill_warmup import common_shapes, warm_prefill

    folder = make_model("qwen3_next", tmp_path / "m", num_hidden_layers=layers, full_attention_interval=interval)
    svc = InProcessService(folder, max_running=8, aux_slots=64, track_chunk=16, max_step_tokens=64,
                           prefill_chunk=32, pad_shapes=True, row_cache=False)
    assert svc.engine.pads_recurrent
    model_layers = layers_owner(svc.engine.model)["layers"]
    seen = []
    launch = svc.engine.launch
    monkeypatch.setattr(svc.engine, "launch", lambda step: seen.append(
        len(layers_owner(svc.engine.model)["layers"])) or launch(step))
    shapes = list(common_shapes(64, 32, 8, 512))
    assert warm_prefill(svc.engine, 64, 32) == len(shapes)
    assert seen == [leading] * len(shapes) and len(model_layers) == layers
    assert layers_owner(svc.engine.model)["layers"] is model_layers
    monkeypatch.undo()
    assert {(r, n, start + n) for r, n, start in shapes} <= svc.engine.prefill_shapes
    pool = svc.engine.aux_pool
    assert all(not mx.any(a[1:9]).item() for entry in pool.states for a in entry)  # the slots it used, cleared
    rng = random.Random(11)
    reqs = [svc.request(f"w{i}", _ids(rng, 20 + 9 * i), 8) for i in range(3)]
    svc.run({0: reqs})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_a_hybrid_the_probe_refuses_warms_nothing(model_dir):
    from runtime.worker.paths.prefill_warmup import warm_prefill

    svc = InProcessService(model_dir("mamba"), max_running=4, aux_slots=32, pad_shapes=True, row_cache=False)
    assert not svc.engine.pads_recurrent and svc.engine.max_padding > 0
    assert warm_prefill(svc.engine, 64, 32) == 0


@pytest.mark.parametrize(("arch", "leading"), [
    ("qwen3_next", 2),   # delta-net, attention, delta-net, attention
    ("kimi_linear", 3),  # its first layer's MLP is dense, the others' are experts
    ("falcon_h1", 2),    # a CacheList a layer: all of them
    ("llama", 1),        # alike
    ("gemma3_text", 4),  # sliding and global layers of one class: all of them
])
def test_the_warm_up_runs_the_leading_layers_that_hold_each_kind(model_dir, arch, leading):
    from runtime.worker.model.discovery import layers_owner
    from runtime.worker.paths.warmup_layers import leading_layers

    model = load_model(model_dir(arch))[0]
    assert leading_layers(layers_owner(model)["layers"], discover(model)) == leading
