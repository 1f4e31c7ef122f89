"""``worker.pad_shapes``: forwards rounded up to recurring shapes, or run at their own lengths
as mlx-lm runs them; tokens stay mlx-lm's either way on the CPU."""

from __future__ import annotations

import pytest
from harness import InProcessService
from model_factory import make_model, reference_greedy

from runtime.config import ConfigError, parse_config
from runtime.worker.paths.rows.compiled_decode import row_step_compiled
from runtime.worker.paths.prefill_shapes import padding_wanted, prefill_length


def test_setting_values():
    assert parse_config({"model": {"path": "/m"}}).worker.pad_shapes == "auto"
    assert parse_config({"model": {"path": "/m"}, "worker": {"pad_shapes": "off"}}).worker.pad_shapes == "off"
    with pytest.raises(ConfigError, match="pad_shapes"):
        parse_config({"model": {"path": "/m"}, "worker": {"pad_shapes": "yes"}})
    assert padding_wanted("auto", on_gpu=True) and not padding_wanted("auto", on_gpu=False)
    assert padding_wanted("on", on_gpu=False) and not padding_wanted("off", on_gpu=True)


def test_row_step_compiled_on_cuda_only_where_shapes_are_padded():
    assert row_step_compiled(on_cpu=True, padded=False, cuda=False)
    assert row_step_compiled(on_cpu=True, padded=True, cuda=True)  # a CUDA build's CPU stream
    assert row_step_compiled(on_cpu=False, padded=True, cuda=True)
    assert not row_step_compiled(on_cpu=False, padded=False, cuda=True)  # told to keep mlx-lm's shapes
    assert not row_step_compiled(on_cpu=False, padded=True, cuda=False)  # Metal: not measured there


@pytest.mark.parametrize("pad", [True, False])
def test_prefill_shapes_follow_the_setting(tmp_path, pad):
    folder = make_model("llama", tmp_path / "m")
    svc = InProcessService(folder, max_running=4, prefill_chunk=64, max_step_tokens=128, pad_shapes=pad)
    prompts = [[3 + (i * 7 + j) % 200 for j in range(n)] for i, n in enumerate((38, 21, 75))]
    reqs = [svc.request(f"r{i}", p, 6) for i, p in enumerate(prompts)]
    svc.run({0: reqs[:1], 2: reqs[1:]})
    queries = {n for _, n, _ in svc.engine.prefill_shapes}
    # A 38-token prompt prefills 37 positions (its last token is the first decode input).
    assert (prefill_length(37) in queries) == pad and (37 in queries) != pad
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
