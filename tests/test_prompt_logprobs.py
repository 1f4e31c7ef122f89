"""Prompt logprobs: each prompt token's log-probability given the tokens before it, against
the log-softmax of mlx-lm's own forward over the whole prompt."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from harness import InProcessService
from model_factory import load_cached, reference_greedy
from test_paged_attention import _reference_kernels


def _expected(folder, prompt: list[int]) -> np.ndarray:
    """mlx-lm's float32 log-softmax at each prompt position (positions 0..n-2 predict 1..n-1)."""
    model, _ = load_cached(folder)
    logits = model(mx.array([prompt]))[0].astype(mx.float32)
    return np.array(logits - mx.logsumexp(logits, axis=-1, keepdims=True))


def _check(folder, req, top_n: int) -> None:
    prompt = req.prompt_ids
    expected = _expected(folder, prompt)
    entries = req.prompt_logprobs
    assert [t for t, _, _ in entries] == prompt[1:]
    got = np.array([lp for _, lp, _ in entries])
    want = expected[np.arange(len(prompt) - 1), prompt[1:]]
    np.testing.assert_allclose(got, want, atol=2e-3, rtol=1e-3)
    for i, (_, _, top) in enumerate(entries):
        assert len(top) == top_n
        order = np.argsort(-expected[i])
        for rank, (token, lp) in enumerate(top):
            assert abs(lp - expected[i, order[rank]]) < 2e-3
            if rank + 1 < len(order) and expected[i, order[rank]] - expected[i, order[rank + 1]] > 1e-2:
                assert token == order[rank]  # not a near-tie: the same token
    assert req.output_ids == reference_greedy(folder, prompt, req.max_new)


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"], ids=["attention", "hybrid"])
def test_prompt_logprobs_over_chunks_and_without_the_prefix_cache(arch, model_dir):
    folder = model_dir(arch)
    hybrid = arch == "qwen3_next"
    svc = InProcessService(folder, max_running=8, prefill_chunk=16, max_step_tokens=48,
                           aux_slots=64 if hybrid else 0, track_chunk=8)
    rng = random.Random(2)
    prompt = [rng.randrange(3, 250) for _ in range(45)]  # three chunks of 16
    warm = svc.request("warm", prompt, 3)
    svc.run({0: [warm]})
    asked = svc.request("asked", prompt, 4, prompt_logprobs=2)
    plain = svc.request("plain", prompt, 4)  # beside it: a prefix hit, no prompt logprobs
    busy = svc.request("busy", [rng.randrange(3, 250) for _ in range(20)], 12)
    svc.run({0: [busy], 2: [asked, plain]})
    assert asked.prefix_len == 0 and plain.prefix_len > 0 and not plain.prompt_logprobs
    _check(folder, asked, 2)


def test_prompt_logprobs_on_the_kernel_path_skip_the_fused_step(model_dir, monkeypatch):
    """A chunk that asks is never fused (the fused forward computes no prefill logits)."""
    _reference_kernels(monkeypatch)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=8, row_cache=False, prefill_chunk=16, max_step_tokens=48)
    assert svc.engine.fuse_prefill
    svc.engine.max_padding = 0.25  # the GPU's: chunks padded to recurring shapes
    rng = random.Random(4)
    busy = svc.request("busy", [rng.randrange(3, 250) for _ in range(20)], 16)
    asked = svc.request("asked", [rng.randrange(3, 250) for _ in range(30)], 3, prompt_logprobs=0)
    svc.run({0: [busy], 2: [asked]})
    _check(folder, asked, 0)
    assert busy.output_ids == reference_greedy(folder, busy.prompt_ids, busy.max_new)
