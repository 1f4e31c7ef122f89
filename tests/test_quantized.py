"""A 4-bit quantized model (how most real MLX models ship) is served token-exact."""

from __future__ import annotations

import json
import random
import shutil

import mlx.core as mx
import mlx.nn as nn
from harness import InProcessService
from mlx_lm.utils import load_model, save_config, save_model
from model_factory import reference_greedy


def test_quantized_llama_is_token_exact(model_dir, tmp_path):
    src = model_dir("llama")
    model, config = load_model(src)
    nn.quantize(model, group_size=32, bits=4)
    folder = tmp_path / "llama-4bit"
    folder.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(src / name, folder / name)
    config["quantization"] = {"group_size": 32, "bits": 4}
    save_model(folder, model)
    save_config(config, folder / "config.json")
    assert json.loads((folder / "config.json").read_text())["quantization"]["bits"] == 4

    svc = InProcessService(folder)
    assert svc.engine.layout.kv_dtype == mx.float32  # a float KV dtype despite uint32 weights
    rng = random.Random(2)
    shared = [rng.randrange(3, 250) for _ in range(20)]
    reqs = [svc.request(f"q{i}", shared + [rng.randrange(3, 250) for _ in range(1 + i)], 10) for i in range(6)]
    svc.run({0: reqs[:3], 2: reqs[3:]})
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, 10)
    assert sum(r.prefix_len for r in reqs) > 0
