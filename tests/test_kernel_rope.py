"""RoPE left to the paged decode kernel (``worker/model/kernel_rope.py``, ``rope_probe.py``).

The kernel itself is CUDA (its rotation is checked bit for bit against ``mx.fast.rope`` in
``test_paged_kernel_cuda.py`` and simulated in ``test_paged_kernel_sim.py``); here the CPU runs
the kernel path with reference kernels that rotate with ``mx.fast.rope``, so what is checked
is which models defer their rotation, that a deferred model's tokens stay mlx-lm's, and that
the start-up check catches a rotation that differs.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import pytest
from mlx_lm.models import llama
from mlx_lm.models.base import scaled_dot_product_attention  # routed by attention_patch, as in mlx-lm
from mlx_lm.models.rope_utils import Llama3RoPE, SuScaledRoPE, YarnRoPE
from near_tie import assert_greedy_like_mlx
from test_paged_attention import _append_reference, _reference_kernels

from runtime.worker.model import attention_patch
from runtime.worker.model.kernel_rope import BASE, FREQS, DeferrableRoPE, rope_spec
from runtime.worker.model.rope_probe import agrees

ARGS = llama.ModelArgs(model_type="llama", hidden_size=64, num_hidden_layers=1, intermediate_size=128,
                       num_attention_heads=4, rms_norm_eps=1e-5, vocab_size=100, num_key_value_heads=2)


def test_only_rotary_modules_of_known_arithmetic_have_a_spec():
    plain = rope_spec(nn.RoPE(16, traditional=True, base=500000.0, scale=0.5))
    assert (plain.mode, plain.dims, plain.traditional, plain.scale, plain.base) == (BASE, 16, True, 0.5, 500000.0)
    scaled = rope_spec(Llama3RoPE(16, 4096, False, 500000.0, scaling_config={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64}))
    assert scaled.mode == FREQS and scaled.freqs.shape == (8,) and scaled.base is None
    x = mx.random.normal((2, 4, 1, 16), key=mx.random.key(0))
    positions = mx.array([3, 900])
    llama3 = Llama3RoPE(16, 4096, False, 500000.0, scaling_config={
        "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    assert mx.array_equal(scaled.rotate(x, positions), llama3(x, offset=positions)).item()
    # YaRN scales its input, LongRoPE its frequencies by the length: left to the model.
    assert rope_spec(YarnRoPE(16)) is None
    assert rope_spec(SuScaledRoPE(16, original_max_position_embeddings=32, short_factor=[1.0] * 8,
                                  long_factor=[2.0] * 8)) is None


class _Layer(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.self_attn = attention


class _Model(nn.Module):
    def __init__(self, attention: nn.Module) -> None:
        super().__init__()
        self.layers = [_Layer(attention)]


def _deferrable(attention: nn.Module) -> nn.Module:
    """``attention`` with its attention call routed (``attention_patch``) and its rope wrapped."""
    assert attention_patch.install(_Model(attention), ("self_attn",))
    attention.rope = DeferrableRoPE(attention.rope)
    return attention


class _Variant(llama.Attention):
    """mlx-lm's llama attention with its rotation step (``rotate``) replaced."""

    def rotate(self, q: mx.array, k: mx.array, offset) -> tuple[mx.array, mx.array]:
        raise NotImplementedError

    def __call__(self, x, mask=None, cache=None):
        b, n, _ = x.shape
        q = self.q_proj(x).reshape(b, n, self.n_heads, -1).transpose(0, 2, 1, 3)
        k = self.k_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        v = self.v_proj(x).reshape(b, n, self.n_kv_heads, -1).transpose(0, 2, 1, 3)
        q, k = self.rotate(q, k, cache.offset)
        k, v = cache.update_and_fetch(k, v)
        out = scaled_dot_product_attention(q, k, v, cache=cache, scale=self.scale, mask=mask)
        return self.o_proj(out.transpose(0, 2, 1, 3).reshape(b, n, -1))


class _RotatedQueriesSquashed(_Variant):
    """Does something to the rotated queries: deferring the rotation past it changes the output."""

    def rotate(self, q, k, offset):
        return mx.tanh(self.rope(q, offset=offset)), self.rope(k, offset=offset)


class _OffsetShifted(_Variant):
    """Computes with its cache offset: a deferred offset is no number."""

    def rotate(self, q, k, offset):
        return self.rope(q, offset=offset + 1), self.rope(k, offset=offset + 1)


class _KeysOnly(_Variant):
    """Rotates its keys alone."""

    def rotate(self, q, k, offset):
        return q, self.rope(k, offset=offset)


def test_the_probe_defers_only_where_the_step_stays_the_same():
    spec = rope_spec(nn.RoPE(16))
    assert agrees(_deferrable(llama.Attention(ARGS)), spec)
    for kind in (_RotatedQueriesSquashed, _OffsetShifted, _KeysOnly):
        assert not agrees(_deferrable(kind(ARGS)), spec), kind.__name__
    # Not routed to a paged view: the attention call never reaches the probe's cache.
    unrouted = llama.Attention(ARGS)
    unrouted.rope = DeferrableRoPE(unrouted.rope)
    assert agrees(unrouted, spec) == attention_patch.is_installed(llama)


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


@pytest.mark.parametrize("rope_scaling", [None, LLAMA3], ids=["base", "llama3"])
def test_a_deferred_rotation_keeps_mlx_lm_s_tokens(rope_scaling, tmp_path, monkeypatch):
    """The compiled kernel-path step with the rotation left to the (reference) kernel: the
    model's rotary modules pass their input through, and the tokens are mlx-lm's."""
    from harness import InProcessService
    from model_factory import make_model

    _reference_kernels(monkeypatch)
    folder = make_model("llama", tmp_path / "m", rope_scaling=rope_scaling)
    svc = InProcessService(folder, max_running=4, row_cache=False)
    specs = svc.engine.paths.rope
    assert specs is not None and {s.mode for s in specs} == {FREQS if rope_scaling else BASE}
    reqs = [svc.request(f"r{i}", [5 + i, 17, 33, 2 * i + 40] * (3 + 4 * i), 12) for i in range(3)]
    svc.run({0: reqs[:2], 3: reqs[2:]})
    for r in reqs:
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)


def test_a_rotation_that_differs_fails_the_start_up_check(monkeypatch):
    from runtime.worker.paths.cuda.kernel_check import check_kernel_rope
    from runtime.worker.paths.paged_attention import PagedAttention

    _reference_kernels(monkeypatch)
    spec = rope_spec(nn.RoPE(32, base=10000.0))
    assert check_kernel_rope(PagedAttention(True), mx.float32, 2, 2, 32, (spec,), [(1, 4), (2, 4)], 4096) is None

    def a_position_late(self, inputs, scale, launch, rope=None, sinks=None):
        if rope is not None:
            rope = (rope[0], rope[1] + 1)
        return _append_reference(self, inputs, scale, launch, rope, sinks)

    monkeypatch.setattr(PagedAttention, "_append_attend", a_position_late)
    problem = check_kernel_rope(PagedAttention(True), mx.float32, 2, 2, 32, (spec,), [(1, 4)], 4096)
    assert problem is not None and "differ from MLX's rope" in problem


def test_a_model_whose_rotation_the_kernel_cannot_do_keeps_its_own(tmp_path, monkeypatch):
    """YaRN (``YarnRoPE``, which scales its input) has no spec: no deferral, and its own rotation."""
    from harness import InProcessService
    from model_factory import make_model

    _reference_kernels(monkeypatch)
    folder = make_model("llama", tmp_path / "m", rope_scaling={"rope_type": "yarn", "factor": 2.0,
                                                              "original_max_position_embeddings": 64})
    svc = InProcessService(folder, max_running=4, row_cache=False)
    assert svc.engine.compiled_paged is not None and svc.engine.paths.rope is None
    r = svc.request("r", [5, 17, 33, 40] * 5, 8)
    svc.run({0: [r]})
    assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)


# Kernel-path families (test_fused_families.KERNEL_PATH) whose layers keep their own rotation.
ROPE_KEPT = {
    "llama4": "RMS-normalizes its rotated queries and keys (the probe sees the order matter)",
    "hunyuan": "DynamicNTKAlphaRoPE", "hunyuan_v1_dense": "DynamicNTKAlphaRoPE",
    "minicpm3": "SuScaledRoPE (LongRoPE)",
    "nanbeige": "a looped stack: one module for several pool layers",
    "nemotron-nas": "attention-free blocks among the layers",
    "nanochat": "its own rotation, no rotary module", "qwen": "its own rotation, no rotary module",
    "talkie": "its own rotation, no rotary module", "gpt2": "learned positions", "gpt_bigcode": "learned positions",
}


# Families with layers that rotate themselves (NoPE) beside layers whose rotation the kernel does.
MIXED = {"smollm3", "llama4_text"}


def test_which_kernel_path_families_leave_rope_to_the_kernel(model_dir, monkeypatch):
    from test_fused_families import KERNEL_PATH, _service

    _reference_kernels(monkeypatch)
    specs = {arch: _service(model_dir(arch)).engine.paths.rope for arch in KERNEL_PATH}
    kept = {arch for arch, s in specs.items() if s is None}
    assert kept == set(ROPE_KEPT), " ".join(sorted(kept ^ set(ROPE_KEPT)))
    mixed = {arch for arch, s in specs.items() if s is not None and None in s}
    assert mixed == MIXED, " ".join(sorted(mixed ^ MIXED))


def test_a_layer_that_rotates_nothing_in_a_step_gets_the_kernel_that_does_not_rotate(model_dir, monkeypatch):
    """A layer whose rotary module was not asked to rotate in a step (no RoPE in that layer;
    here the second layer rotates by itself, out of the wrapper's count) attends through the
    plain kernel: rotating again would change its tokens."""
    from harness import InProcessService

    from runtime.worker.model.kernel_rope import DeferredOffset

    _reference_kernels(monkeypatch)
    made: list[DeferrableRoPE] = []
    init, call = DeferrableRoPE.__init__, DeferrableRoPE.__call__

    def tagged(self, inner):
        init(self, inner)
        made.append(self)

    def second_rotates_itself(self, x, offset=0):
        if isinstance(offset, DeferredOffset) and len(made) > 1 and made[1] is self:
            return self.inner(x, offset=offset.positions)
        return call(self, x, offset)

    monkeypatch.setattr(DeferrableRoPE, "__init__", tagged)
    monkeypatch.setattr(DeferrableRoPE, "__call__", second_rotates_itself)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=4, row_cache=False)
    assert svc.engine.paths.rope is not None and len(made) == 2
    r = svc.request("r", [5, 17, 33, 40] * 6, 12)
    svc.run({0: [r]})
    assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)


def test_a_forward_that_reads_the_offset_elsewhere_keeps_its_own_rotation(model_dir, monkeypatch):
    """Something outside the attention modules computes with the offset (which the probe, one
    module's run, cannot see): the compiled step fails to trace with the rotation left to the
    kernel, traces again rotating itself, and the tokens are mlx-lm's."""
    from harness import InProcessService

    _reference_kernels(monkeypatch)
    forward = llama.LlamaModel.__call__

    def reads_the_offset(self, inputs, cache=None, *args, **kwargs):
        if cache is not None and cache[0] is not None:
            cache[0].offset + 0  # a number (or per-row array) in every cache the runtime hands in
        return forward(self, inputs, cache, *args, **kwargs)

    monkeypatch.setattr(llama.LlamaModel, "__call__", reads_the_offset)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=4, row_cache=False)
    assert svc.engine.paths.rope is not None  # the probe passed ...
    r = svc.request("r", [5, 17, 33, 40] * 6, 12)
    svc.run({0: [r]})
    assert svc.engine.compiled_paged.rope is None  # ... the first trace did not
    assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)
