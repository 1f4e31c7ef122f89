"""Gemma-style RMSNorms with ``1 + weight`` computed once at load (``model/norm_offsets``).

The change must leave every logit's bits as they were (the load-time probe checks it, and so
does this test on whole models), stop the per-call add, keep the parameters as loaded, and
leave norms of any other form alone. Every service test of the Gemma families runs through it.
"""

from __future__ import annotations

import json

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from runtime.worker.model.logit_probe import probe_logits, probe_tokens
from runtime.worker.model.norm_offsets import adds_one, precompute_offsets


def _fresh(model_dir, arch: str):
    folder = model_dir(arch)
    model, _ = load_model(folder)  # not a cached one: its norms change class
    return model, json.loads((folder / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize("arch", ["gemma3_text", "gemma", "gemma2", "recurrent_gemma"])
def test_the_norms_keep_every_logit_and_the_parameters(model_dir, arch):
    model, vocab = _fresh(model_dir, arch)
    tokens = mx.array([[5, 17, 3, 99 % vocab, 42, 7, 1, 64 % vocab]], dtype=mx.uint32)
    before = probe_logits(model, tokens)
    params = {k: v for k, v in tree_flatten(model.parameters())}
    changed = precompute_offsets(model, vocab)
    assert changed >= 3  # at least the norms around one block's sublayers and the final norm
    assert mx.array_equal(probe_logits(model, tokens), before).item()
    assert {k: v for k, v in tree_flatten(model.parameters())}.keys() == params.keys()  # the sum is not a parameter
    assert precompute_offsets(model, vocab) == 0  # applied once


def test_the_add_runs_once_not_every_call(model_dir, monkeypatch):
    model, vocab = _fresh(model_dir, "gemma3_text")
    assert precompute_offsets(model, vocab) > 0
    norm = next(m for _, m in model.named_modules() if hasattr(m, "held_weight"))
    seen = []
    real = mx.fast.rms_norm
    monkeypatch.setattr(mx.fast, "rms_norm", lambda x, w, eps: seen.append(w) or real(x, w, eps))
    x = mx.ones((1, 2, norm.weight.shape[0]))
    norm(x)
    assert seen[-1] is norm.held_weight.value  # the held sum itself, no new add
    norm.weight = norm.weight * 2  # a replaced weight: the norm computes its own sum again
    out = norm(x)
    assert seen[-1] is not norm.held_weight.value
    assert mx.array_equal(out, real(x, 1.0 + norm.weight, norm.eps)).item()


class _Scaled(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.weight = mx.ones((4,))
        self.eps = 1e-6

    def __call__(self, x):
        return mx.fast.rms_norm(x, 2.0 + self.weight, self.eps)


class _Keyword(_Scaled):
    def __call__(self, x):
        return mx.fast.rms_norm(x, weight=self.weight + 1, eps=self.eps)


class _Cast(_Scaled):
    def __call__(self, x):
        return mx.fast.rms_norm(x, (1.0 + self.weight).astype(x.dtype), self.eps)


def test_only_the_exact_form_is_recognized():
    assert adds_one(_Keyword)
    assert not adds_one(_Scaled) and not adds_one(_Cast) and not adds_one(nn.RMSNorm)


def test_a_model_whose_logits_would_change_is_left_as_it_was(model_dir, monkeypatch):
    model, vocab = _fresh(model_dir, "gemma3_text")
    import runtime.worker.model.norm_offsets as offsets

    monkeypatch.setattr(offsets, "_Held", lambda source, value: type("H", (), {"source": source,
                                                                                "value": value * 1.5})())
    before = probe_logits(model, probe_tokens(vocab))
    assert precompute_offsets(model, vocab) == 0
    assert not any(hasattr(m, "held_weight") for _, m in model.named_modules())
    assert mx.array_equal(probe_logits(model, probe_tokens(vocab)), before).item()


def test_the_service_reports_the_norms_and_the_fused_gemma_blocks(model_dir, service_factory):
    with service_factory(model_dir("gemma3_text")) as svc:
        norms = next(ln for ln in svc.lines if "RMSNorms of 1 + weight" in ln)
        blocks = next(ln for ln in svc.lines if "add their residuals" in ln)
    # Four layers: six norms each (four around the sublayers, q and k), and the final norm.
    assert "25 RMSNorms" in norms and "4 blocks" in blocks


def test_the_loaders_transformations_share_one_reference_forward(model_dir, monkeypatch):
    from runtime.worker.model import logit_probe
    from runtime.worker.model.fused_residual import fuse_residuals
    from runtime.worker.paths.cuda.add_rms_norm import AddRmsNorm

    model, vocab = _fresh(model_dir, "gemma3_text")
    calls = []
    real = logit_probe.probe_logits
    monkeypatch.setattr(logit_probe, "probe_logits", lambda m, t: calls.append(1) or real(m, t))
    probe = logit_probe.LogitProbe(model, vocab)
    assert precompute_offsets(model, vocab, probe) > 0 and fuse_residuals(model, AddRmsNorm(False), vocab, probe) > 0
    assert len(calls) == 3  # the reference once, then one check after each transformation
