"""Residual adds fused with the RMSNorm after them (``model/fused_residual``, ``paths/cuda/add_rms_norm``).

On the CPU the fused operation is MLX's own two kernels, so these tests check the blocks'
new forward (which adds and norms it asks for, the handoff to the next norm, the probe that
leaves other blocks alone); the service tests of every family run through it too. The kernel's
bits against MLX's are checked where a GPU is (the last test) and at every worker start there.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx.utils import tree_flatten
from mlx_lm.utils import load_model

from runtime.worker.model.fused_residual import HandoffRMSNorm, fuse_residuals
from runtime.worker.paths.cuda import add_rms_norm
from runtime.worker.paths.cuda.add_rms_norm import AddRmsNorm, launch_geometry

ROOT = Path(__file__).resolve().parents[1]


class CountingAddNorm(AddRmsNorm):
    """MLX's kernels, counting the calls."""

    def __init__(self) -> None:
        super().__init__(False)
        self.calls = 0

    def __call__(self, x, r, weight, eps):
        self.calls += 1
        return super().__call__(x, r, weight, eps)


def _fresh(model_dir, arch: str):
    folder = model_dir(arch)
    model, _ = load_model(folder)  # not the cached one: its blocks change class
    return model, json.loads((folder / "config.json").read_text())["vocab_size"]


@pytest.mark.parametrize(("width", "itemsize", "geometry"), [
    (2048, 2, (128, 2)),  # Llama-3.2-1B
    (4096, 2, (128, 4)),  # Llama-3.1-8B
    (3072, 2, (128, 3)),
    (2560, 2, (64, 5)),  # 320 vectors: not 128s, 64s
    (512, 2, (64, 1)),
    (5000, 2, (128, 5)),  # 625 vectors: rounded up to 128s
    (8192, 2, (128, 8)),
    (8200, 2, None),  # past MLX's small kernel: its wide one, not fused
    (4096, 4, (128, 8)),
])
def test_the_launch_is_the_one_mlx_rms_norm_takes(width, itemsize, geometry):
    assert launch_geometry(width, itemsize) == geometry


def test_the_check_says_where_the_kernel_does_not_apply():
    """A float32 model or a row wider than MLX's small kernel takes MLX's kernels: the start-up
    check says so, rather than passing a kernel that will never run."""
    assert "take MLX's own kernels" in AddRmsNorm(True).check(64, mx.float32)
    assert "take MLX's own kernels" in AddRmsNorm(True).check(8200, mx.bfloat16)


def test_the_kernel_takes_a_decode_steps_rows_and_leaves_a_prefills_to_mlx(monkeypatch):
    """Up to ``MAX_KERNEL_ROWS`` rows (a decode step) go to the kernel; a prefill forward's many rows
    keep MLX's two kernels (the same bits)."""
    launched: list[int] = []

    def fake_kernel(**build):
        def run(inputs, grid, threadgroup, **launch):
            launched.append(grid[0] // threadgroup[0])  # one block a row
            return add_rms_norm.reference(inputs[0], inputs[1], inputs[2], inputs[3].item())
        return run

    monkeypatch.setattr(add_rms_norm, "cuda_kernel", fake_kernel)
    fused = AddRmsNorm(True)
    w = mx.ones((64,), dtype=mx.bfloat16)
    for shape in ((1, 1, 64), (add_rms_norm.MAX_KERNEL_ROWS, 1, 64), (4, 300, 64)):
        x = mx.ones(shape, dtype=mx.bfloat16)
        h, out = fused(x, x, w, 1e-5)
        assert mx.array_equal(out, add_rms_norm.reference(x, x, w, 1e-5)[1]).item()
    assert launched == [1, add_rms_norm.MAX_KERNEL_ROWS]  # not the 1,200 rows of the prefill


def test_a_llama_model_takes_the_fused_blocks_and_keeps_its_logits_and_parameters(model_dir):
    model, vocab = _fresh(model_dir, "llama")
    tokens = mx.array([[5, 9, 2, 7, 11]], dtype=mx.uint32)
    before = model(tokens)
    keys = [k for k, _ in tree_flatten(model.parameters())]
    op = CountingAddNorm()
    assert fuse_residuals(model, op, vocab) == len(model.model.layers)
    assert all(type(layer).__name__.startswith("Fused") for layer in model.model.layers)
    assert type(model.model.norm) is HandoffRMSNorm
    assert [k for k, _ in tree_flatten(model.parameters())] == keys  # the module tree is as loaded
    op.calls = 0
    norms_called = []
    plain = nn.RMSNorm.__call__

    def counted(self, x):
        norms_called.append(self)
        return plain(self, x)

    nn.RMSNorm.__call__ = counted
    try:
        after = model(tokens)
    finally:
        nn.RMSNorm.__call__ = plain
    assert mx.array_equal(after, before).item()
    # Two fused adds a block; of the norms only the first layer's input norm runs by itself: every
    # later one, and the final norm, gets the row its previous block computed.
    assert op.calls == 2 * len(model.model.layers)
    assert norms_called == [model.model.layers[0].input_layernorm]
    assert model.model.norm.handoff.h is None  # nothing held past the forward


@pytest.mark.parametrize(("arch", "feed_forward"), [("mixtral", "block_sparse_moe"), ("llama4_text", "feed_forward"),
                                                   ("internlm2", "feed_forward"), ("granite", "mlp"),
                                                   ("granitemoe", "block_sparse_moe"), ("glm4", "mlp"),
                                                   ("apertus", "mlp"), ("ministral3", "mlp"), ("mistral4", "mlp")])
def test_blocks_fuse_around_parts_of_other_names(model_dir, arch, feed_forward):
    """Mixtral's MLP is ``block_sparse_moe``, Llama 4's ``feed_forward``; InternLM2 names all
    four parts its own way (``attention``, ``attention_norm``, ``ffn_norm``, ``feed_forward``);
    Granite scales each sublayer's output by its ``residual_multiplier`` before the add; GLM-4
    normalizes each sublayer's output before its add, as Gemma 2 and 3 do, under other names;
    Ministral 3's and Mistral 4's blocks take an ``attn_scale`` for their attention."""
    model, vocab = _fresh(model_dir, arch)
    tokens = mx.array([[5, 9, 2, 7, 11]], dtype=mx.uint32)
    before = model(tokens)
    op = CountingAddNorm()
    assert fuse_residuals(model, op, vocab) == len(model.model.layers)
    assert {layer.fused_links.parts.feed_forward for layer in model.model.layers} == {feed_forward}
    op.calls = 0
    assert mx.array_equal(model(tokens), before).item()
    assert op.calls == 2 * len(model.model.layers)


@pytest.mark.parametrize(("arch", "flag", "when_set", "otherwise"), [
    ("qwen3_next", "is_linear", "linear_attn", "self_attn"), ("qwen3_5", "is_linear", "linear_attn", "self_attn"),
    ("lfm2", "is_attention_layer", "self_attn", "conv")])
def test_blocks_that_pick_their_mixer_by_a_layer_flag_fuse_with_it(model_dir, arch, flag, when_set, otherwise):
    """Qwen3-Next's blocks run ``linear_attn`` or ``self_attn`` by a per-layer ``is_linear``,
    LFM2's attention or a convolution: the fused forward calls the one its layer runs."""
    model, vocab = _fresh(model_dir, arch)
    layers = _owner_layers(model)
    tokens = mx.array([[5, 9, 2, 7, 11]], dtype=mx.uint32)
    before = model(tokens)
    assert fuse_residuals(model, AddRmsNorm(False), vocab) == len(layers)
    mixers = [layer.fused_links.parts.mixer for layer in layers]
    assert mixers == [when_set if getattr(layer, flag) else otherwise for layer in layers]
    assert set(mixers) == {when_set, otherwise}  # both kinds in the probe's model
    assert mx.array_equal(model(tokens), before).item()


@pytest.mark.parametrize("arch", ["gemma", "gemma2", "gemma3_text"])
def test_gemma_blocks_fuse_with_their_held_norm_weights(model_dir, arch):
    """Gemma's norms scale by ``1 + weight`` (held once by ``norm_offsets``); Gemma 2 and 3 also
    normalize each sublayer's output before its add, and the first add goes on to
    ``pre_feedforward_layernorm``: the fused forward keeps all of it, bit for bit."""
    from runtime.worker.model.norm_offsets import precompute_offsets

    model, vocab = _fresh(model_dir, arch)
    layers = _owner_layers(model)
    tokens = mx.array([[5, 9, 2, 7, 11, 3]], dtype=mx.uint32)
    before = model(tokens)
    assert precompute_offsets(model, vocab) > 0
    op = CountingAddNorm()
    assert fuse_residuals(model, op, vocab) == len(layers)
    op.calls = 0
    assert mx.array_equal(model(tokens), before).item()
    assert op.calls == 2 * len(layers)
    assert all(type(layer.input_layernorm).__name__.startswith("Handoff") for layer in layers[1:])


def test_gemma3_in_float16_keeps_its_clipped_residuals(model_dir):
    from runtime.worker.model.norm_offsets import precompute_offsets

    model, vocab = _fresh(model_dir, "gemma3_text")
    model.set_dtype(mx.float16)  # clip_residual clips its sums here, which the fused add does not
    precompute_offsets(model, vocab)
    assert fuse_residuals(model, AddRmsNorm(False), vocab) == 0


def _owner_layers(model) -> list:
    inner = getattr(model, "language_model", model)
    return inner.model.layers


def test_a_branch_on_anything_but_a_layer_flag_is_no_candidate():
    import mlx_lm.models.qwen3_next as qwen3_next

    from runtime.worker.model import block_parts

    class Branching(qwen3_next.Qwen3NextDecoderLayer):
        def __call__(self, x, mask=None, cache=None):
            if x.shape[1] > 1:
                r = self.linear_attn(self.input_layernorm(x), mask, cache)
            else:
                r = self.self_attn(self.input_layernorm(x), mask, cache)
            h = x + r
            return h + self.mlp(self.post_attention_layernorm(h))

    naming = block_parts.LLAMA
    assert block_parts.forward_plan(qwen3_next.Qwen3NextDecoderLayer, naming, "mlp") == block_parts.Plan(
        "is_linear", "linear_attn", "self_attn")
    assert block_parts.forward_plan(Branching, naming, "mlp") is None


def test_a_handoff_norm_normalizes_any_other_array_itself(model_dir):
    model, vocab = _fresh(model_dir, "llama")
    assert fuse_residuals(model, AddRmsNorm(False), vocab) > 0
    norm = model.model.norm
    x = mx.random.normal((2, norm.weight.shape[0]))
    norm.handoff.h, norm.handoff.n = mx.zeros_like(x), mx.zeros_like(x)  # for another array
    assert mx.array_equal(norm(x), mx.fast.rms_norm(x, norm.weight, norm.eps)).item()


@pytest.mark.parametrize("arch", ["olmo2", "cohere2"])
def test_blocks_of_another_shape_are_left_as_they_were(model_dir, arch):
    """OLMo 2 normalizes after each sub-block, Cohere 2 runs attention and MLP side by side: the
    probe's logits differ or the block is no candidate, nothing changes."""
    model, vocab = _fresh(model_dir, arch)
    classes = [type(m) for _, m in model.named_modules()]
    assert fuse_residuals(model, AddRmsNorm(False), vocab) == 0
    assert [type(m) for _, m in model.named_modules()] == classes


def test_the_service_reports_the_fused_blocks(model_dir, service_factory):
    with service_factory(model_dir("llama")) as svc:
        line = next(ln for ln in svc.lines if "add their residuals" in ln)
        assert "2 blocks" in line and "MLX's kernels" in line  # the CPU: MLX's two kernels


def _nvrtc():
    spec = importlib.util.spec_from_file_location("nvrtc_check", ROOT / "scripts" / "nvrtc_check.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize(("dtype", "width"), [("__nv_bfloat16", 2048), ("__half", 2560), ("__nv_bfloat16", 8192)])
def test_the_kernel_builds_with_nvrtc(dtype, width):
    nvrtc_check = _nvrtc()
    cuda = nvrtc_check.cuda_folder()
    if cuda is None or not (cuda / "include" / "cccl").is_dir():
        pytest.skip("NVRTC and CCCL from pip (nvidia-cuda-nvrtc, nvidia-cuda-cccl) are not installed")
    block, chunks = launch_geometry(width, 2)
    stub = nvrtc_check.STUB_HEADER.replace("namespace cooperative_groups {}", "")
    source = (stub + add_rms_norm.HEADER + "namespace mlx::core::cu {\n"
              f"__global__ void add_rms_norm(const {dtype}* x, const {dtype}* r, const {dtype}* w, const float* eps,"
              f" {dtype}* h, {dtype}* out) {{\n  using T = {dtype};\n  constexpr int BLOCK = {block};\n"
              f"  constexpr int CHUNKS = {chunks};\n  constexpr int N = {width};\n{add_rms_norm.SOURCE}\n}}\n}}\n")
    nvrtc = nvrtc_check.Nvrtc(next((cuda / "lib").glob("libnvrtc.so.*")))
    built, log, _ = nvrtc.compile(source, nvrtc_check.build_options(cuda, [cuda / "include" / "cccl"]))
    assert built, log[:3000]
    assert nvrtc_check.registers(log)[1] == 0  # no spills


@pytest.mark.skipif(not (mx.default_device().type == mx.DeviceType.gpu and mx.cuda.is_available()),
                    reason="needs MLX on a CUDA GPU")
@pytest.mark.parametrize("width", [2048, 4096, 3072, 2560, 5000, 8192])
@pytest.mark.parametrize("dtype", [mx.bfloat16, mx.float16])
def test_the_kernel_gives_mlx_bits(width, dtype):
    op = AddRmsNorm(True)
    assert op.check(width, dtype, rows=(1, 5, 64, 300)) is None
