"""Fused q/k/v and gate/up projections: bit-identical to the separate ones, token-exact served."""

from __future__ import annotations

import gc
import os
import random
import shutil
import sys

import mlx.core as mx
import mlx.nn as nn
import pytest
from harness import InProcessService
from mlx_lm.models.cache import make_prompt_cache
from mlx_lm.utils import load_model
from model_factory import reference_greedy

from runtime.config import ConfigError, parse_config
from runtime.worker.cpu_blas import is_reference, reference_blas
from runtime.worker.model import fused_projections
from runtime.worker.model.discovery import model_layers
from runtime.worker.model.fused_projections import (
    FusedPart,
    fuse_projections,
    fusion_wanted,
    probe_rows,
    stacked_line,
)


def _projections(model: nn.Module, x: mx.array) -> list[mx.array]:
    out = []
    for layer in model_layers(model):
        attn = getattr(layer, "self_attn", None)
        if attn is not None:
            out += [attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)]
        mlp = getattr(layer, "mlp", None)
        if mlp is not None and hasattr(mlp, "gate_proj"):
            out += [mlp.gate_proj(x), mlp.up_proj(x)]
    mx.eval(out)
    return out


def _decode_logits(model: nn.Module, prompt: list[int]) -> mx.array:
    """mlx-lm's own prefill, then one one-token decode step."""
    cache = make_prompt_cache(model)
    model(mx.array([prompt]), cache=cache)
    logits = model(mx.array([[prompt[-1]]]), cache=cache)
    mx.eval(logits)
    return logits


@pytest.mark.parametrize("arch,quantize", [("llama", False), ("qwen3", False), ("llama", True), ("qwen3_next", False)])
def test_fused_projections_are_bit_identical(model_dir, arch, quantize):
    model, _ = load_model(model_dir(arch))
    if quantize:
        nn.quantize(model, group_size=32, bits=4)
        mx.eval(model.parameters())
    hidden = model.args.hidden_size
    one = mx.random.normal((1, 1, hidden), key=mx.random.key(1))
    many = mx.random.normal((2, 5, hidden), key=mx.random.key(2))
    rows = mx.random.normal((3, 1, hidden), key=mx.random.key(3))  # a three-row decode step's input
    prompt = [5, 17, 33, 2, 90, 41, 7]
    want_one, want_many, want_rows = _projections(model, one), _projections(model, many), _projections(model, rows)
    want_logits = _decode_logits(model, prompt)

    groups = fuse_projections(model)
    layers = model_layers(model)
    assert groups >= len(layers)  # at least one group per layer
    assert fuse_projections(model) == 0  # idempotent: fused parts are not plain linears
    verdicts = probe_rows(model, [1, 3])

    products = []
    product = fused_projections._Stacked._product
    fused_projections._Stacked._product = lambda self, x: products.append(x) or product(self, x)
    try:
        got_one = _projections(model, one)
        calls = len(products)
        got_many = _projections(model, many)
        assert len(products) == calls  # five tokens a row: the separate products
        got_rows = _projections(model, rows)
        row_calls = len(products) - calls
        got_logits = _decode_logits(model, prompt)
    finally:
        fused_projections._Stacked._product = product
    assert calls == (groups if verdicts[1] else 0)  # one product per group, not one per projection
    assert row_calls == (groups if verdicts[3] else 0)
    if verdicts[1]:
        assert len(products) > calls + row_calls  # the decode step took the fused path too
    assert len(got_one) == len(want_one) and len(got_many) == len(want_many) and len(got_rows) == len(want_rows)
    for a, b in zip(want_one + want_many + want_rows, got_one + got_many + got_rows):
        assert a.shape == b.shape and bool(mx.array_equal(a, b))
    assert bool(mx.array_equal(want_logits, got_logits))


def test_probed_row_counts_alone_take_the_stacked_product(model_dir, monkeypatch):
    """A row count whose probe disagreed runs the separate products; one that agreed, the stacked."""
    model, _ = load_model(model_dir("llama"))
    mx.eval(model.parameters())
    hidden = model.args.hidden_size
    inputs = {n: mx.random.normal((n, 1, hidden), key=mx.random.key(n)) for n in (1, 2, 4)}
    want = {n: _projections(model, x) for n, x in inputs.items()}
    groups = fuse_projections(model)
    real = fused_projections._Stacked.agrees
    monkeypatch.setattr(fused_projections._Stacked, "agrees",
                        lambda self, rows, parts: rows != 4 and real(self, rows, parts))
    verdicts = probe_rows(model, [1, 2, 4])
    assert verdicts == {1: True, 2: True, 4: False}  # the test model's groups agree on this CPU
    assert stacked_line(verdicts) == "stacked products at rows 1, 2; separate at 4"
    products = []
    product = fused_projections._Stacked._product
    monkeypatch.setattr(fused_projections._Stacked, "_product", lambda self, x: products.append(x) or product(self, x))
    for n, x in inputs.items():
        before = len(products)
        got = _projections(model, x)
        assert len(products) - before == (0 if n == 4 else groups), n
        assert all(bool(mx.array_equal(a, b)) for a, b in zip(want[n], got)), n


def test_a_probe_that_disagrees_everywhere_stacks_nothing(model_dir, monkeypatch):
    model, _ = load_model(model_dir("qwen3"))
    mx.eval(model.parameters())
    fuse_projections(model)
    assert stacked_line(None) == "one-token inputs stacked"
    monkeypatch.setattr(fused_projections._Stacked, "agrees", lambda self, rows, parts: False)
    assert probe_rows(model, [1, 8]) == {1: False, 8: False}
    products = []
    monkeypatch.setattr(fused_projections._Stacked, "_product", lambda self, x: products.append(x))
    _projections(model, mx.random.normal((1, 1, model.args.hidden_size)))
    assert products == []


def test_fusing_keeps_one_copy_of_the_weights(model_dir):
    model, _ = load_model(model_dir("llama"))
    mx.eval(model.parameters())
    attn = model_layers(model)[0].self_attn
    projection_bytes = sum(m.weight.nbytes for m in (attn.q_proj, attn.k_proj, attn.v_proj)) * len(model_layers(model))
    gc.collect()
    before = mx.get_active_memory()
    fuse_projections(model)
    gc.collect()
    after = mx.get_active_memory()
    assert isinstance(attn.q_proj, FusedPart)
    assert after - before < projection_bytes // 4  # the separate weights were freed, not kept beside the stack


def test_projections_with_a_bias_are_left_alone():
    class Attention(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(16, 16, bias=True) for _ in range(3))

    class MLP(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(16, 32, bias=False), nn.Linear(16, 32, bias=False)

    attn, mlp = Attention(), MLP()
    assert fuse_projections(attn) == 0 and isinstance(attn.q_proj, nn.Linear)
    assert fuse_projections(mlp) == 1 and isinstance(mlp.up_proj, FusedPart)


@pytest.mark.parametrize("arch", ["llama", "qwen3", "qwen3_next"])
def test_fused_service_is_token_exact(model_dir, arch):
    folder = model_dir(arch)
    rng = random.Random(4)
    shared = [rng.randrange(3, 250) for _ in range(30)]
    kwargs = {"aux_slots": 64} if arch == "qwen3_next" else {}
    svc = InProcessService(folder, fuse=True, **kwargs)
    assert any(isinstance(m, FusedPart) for _, m in svc.engine.model.named_modules())
    alone = svc.request("alone", shared + [4, 5], 14)  # one row: every decode step one token
    svc.run({0: [alone]})
    reqs = [svc.request(f"r{i}", shared + [rng.randrange(3, 250) for _ in range(1 + i)], 10) for i in range(4)]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    for r in [alone] + reqs:
        assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), r.rid


def test_fuse_projections_setting():
    assert parse_config({"model": {"path": "/m"}}).worker.fuse_projections == "auto"
    with pytest.raises(ConfigError, match="fuse_projections"):
        parse_config({"model": {"path": "/m"}, "worker": {"fuse_projections": "yes"}})
    assert fusion_wanted("auto", on_gpu=True, compiled_step=True)
    assert not fusion_wanted("auto", on_gpu=False, compiled_step=True)  # a CPU with OpenBLAS
    assert fusion_wanted("auto", on_gpu=False, compiled_step=True, reference_blas=True)
    assert not fusion_wanted("auto", on_gpu=False, compiled_step=False, reference_blas=True)
    assert not fusion_wanted("off", on_gpu=False, compiled_step=True, reference_blas=True)
    assert not fusion_wanted("auto", on_gpu=True, compiled_step=False)  # hybrids, compile_decode off
    assert fusion_wanted("on", on_gpu=False, compiled_step=False)
    assert not fusion_wanted("off", on_gpu=True, compiled_step=True)


def test_reference_blas_is_the_bundled_one_unless_another_cblas_comes_first():
    bundled = "7f36a5758000-7f36a5800000 r-xp 00000000 08:01 1 /venv/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0\n"
    numpy_own = "7f36a5000000-7f36a5100000 r-xp 00000000 08:01 2 /venv/numpy.libs/libscipy_openblas64_-ff651d7f.so\n"
    assert is_reference(bundled + numpy_own, None)  # numpy's prefixed OpenBLAS takes no MLX call
    assert not is_reference(bundled, "/usr/lib/x86_64-linux-gnu/libopenblas.so.0")  # preloaded
    assert is_reference(bundled, "/venv/mlx_cpu.libs/libblas-bd8a282c.so.3.10.0")
    assert not is_reference("/usr/lib/libmlx.so\n", None)  # an MLX built on another BLAS


_COMPILER = shutil.which("cc") or shutil.which("gcc")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="LD_PRELOAD preloads only on Linux")
@pytest.mark.skipif(_COMPILER is None, reason="no C compiler to build the stand-in BLAS with")
def test_a_preloaded_cblas_is_found(tmp_path):
    """``global_cblas`` in a process with a library preloaded that defines ``cblas_sgemm``, as
    ``worker.blas = "auto"`` preloads OpenBLAS; built here with the C compiler."""
    import subprocess

    compiler = _COMPILER
    (tmp_path / "fake.c").write_text("void cblas_sgemm(void) {}\n")
    lib = tmp_path / "libfakeopenblas.so"
    subprocess.run([compiler, "-shared", "-fPIC", "-o", str(lib), str(tmp_path / "fake.c")], check=True)
    probe = "import mlx.core; from runtime.worker.cpu_blas import global_cblas, reference_blas; " \
            "print(global_cblas(), reference_blas())"
    out = {}
    for preload in ("", str(lib)):
        env = {k: v for k, v in os.environ.items() if k != "LD_PRELOAD"} | ({"LD_PRELOAD": preload} if preload else {})
        out[preload] = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, text=True,
                                      check=True).stdout.split()
    assert out[str(lib)] == [str(lib), "False"]
    assert out[""][0] != str(lib)


def test_auto_fuses_on_a_cpu_exactly_when_its_blas_is_the_reference_one(model_dir):
    from runtime.worker.loader import load

    loaded = load(parse_config({"model": {"path": str(model_dir("llama"))}}))
    on_gpu = mx.default_device().type == mx.DeviceType.gpu  # a Mac's Metal GPU fuses whatever the BLAS
    assert (loaded.fused_groups > 0) == (on_gpu or reference_blas())


def test_the_loader_fuses_when_configured(model_dir):
    from runtime.worker.loader import load

    folder = model_dir("llama")
    loaded = {}
    for setting in ("off", "on"):
        config = parse_config({"model": {"path": str(folder)}, "worker": {"fuse_projections": setting}})
        loaded[setting] = load(config)
    layers = len(model_layers(loaded["on"].model))
    assert loaded["off"].fused_groups == 0 and loaded["on"].fused_groups == 2 * layers  # q/k/v and gate/up
    assert loaded["off"].stacked_rows is None
    classes = sorted(loaded["on"].stacked_rows)  # every decode row class up to max_running was probed
    assert classes[0] == 1 and classes[-1] >= loaded["on"].limits.max_running
    assert isinstance(model_layers(loaded["on"].model)[0].mlp.gate_proj, FusedPart)
    prompt = [9, 8, 7, 6, 5]
    assert bool(mx.array_equal(_decode_logits(loaded["off"].model, prompt), _decode_logits(loaded["on"].model, prompt)))
