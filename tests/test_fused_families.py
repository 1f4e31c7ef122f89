"""Every architecture that takes the CUDA kernel path, with its fused prefill + decode steps
(the GPU's default), token-exact against mlx-lm: run on the CPU with the kernels replaced by
their reference computations. Families off that path (sliding windows, recurrent state,
latent attention) decode through the paths their own tests cover."""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from model_factory import ARCHS, REFUSED, reference_greedy
from test_paged_attention import _reference_kernels

KERNEL_PATH = ("llama", "qwen3", "phi3", "bailing_moe", "mistral", "qwen2", "qwen3_moe", "mixtral", "gemma",
               "olmo2", "granite", "minicpm", "starcoder2", "smollm3", "glm4", "ernie4_5", "hunyuan",
               "hunyuan_v1_dense", "glm", "lille-130m", "llama4_text", "mimo", "nanbeige", "nanochat", "nemotron-nas",
               "qwen", "solar_open", "talkie", "telechat3", "internlm2", "internlm3",
               "olmoe", "granitemoe", "qwen2_moe", "phimoe", "phixtral", "ernie4_5_moe", "glm4_moe", "dots1", "Klear", "minimax",
               "apertus", "cohere", "deepseek", "exaone", "gpt2", "gpt_neox", "gptj", "helium", "minicpm3",
               "mistral3", "nemotron", "phi", "seed_oss", "gpt_bigcode", "llama4",
               "pixtral", "qwen2_vl", "qwen3_vl", "qwen3_vl_moe")


def _service(folder) -> InProcessService:
    return InProcessService(folder, max_running=8, row_cache=False, aux_slots=64, max_step_tokens=96, prefill_chunk=16)


def test_which_families_take_the_fused_kernel_path(model_dir, monkeypatch):
    _reference_kernels(monkeypatch)
    fused = set()
    for arch in (a for a in ARCHS if a not in REFUSED):
        engine = _service(model_dir(arch)).engine
        assert engine.fuse_prefill == (engine.compiled_paged is not None and engine.paths.tail is not None
                                       and engine.aux_pool is None)
        if engine.fuse_prefill:
            fused.add(arch)
    assert fused == set(KERNEL_PATH), " ".join(sorted(fused ^ set(KERNEL_PATH)))


@pytest.mark.parametrize("arch", KERNEL_PATH)
def test_fused_steps_of_every_kernel_path_family_decode_as_mlx_lm(arch, model_dir, monkeypatch):
    """Requests arriving while others decode (their chunks fused beside the decode rows, with
    the GPU's prefill padding), prefix hits among them."""
    from runtime.worker.engine import Engine

    _reference_kernels(monkeypatch)
    fused = []
    run_fused = Engine._fused_logits
    monkeypatch.setattr(Engine, "_fused_logits", lambda self, *a: fused.append(1) or run_fused(self, *a))
    folder = model_dir(arch)
    svc = _service(folder)
    svc.engine.max_padding = 0.25  # the GPU's share
    rng = random.Random(3)
    shared = [rng.randrange(3, 250) for _ in range(24)]
    reqs = [svc.request(f"r{i}", shared[: 8 + 5 * i] + [rng.randrange(3, 250) for _ in range(3 + 4 * i)], 6 + 2 * (i % 3))
            for i in range(6)]
    svc.run({0: reqs[:2], 2: reqs[2:4], 4: reqs[4:]})
    assert len(fused) >= 2 and sum(r.prefix_len > 0 for r in reqs) >= 2
    for r in reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid
