"""The delta-net kernel (``paths/cuda/gated_delta.py``): its CUDA source run on the CPU
(``cuda_sim``'s stubs, one thread per lane) against mlx-lm's ops path, the scope that puts it in
the ops path's place, and the worker's prefill and decode taking that scope."""

from __future__ import annotations

import subprocess

import mlx.core as mx
import numpy as np
import pytest
from cuda_sim import RUNNER, STUBS, bf16_bits, binary, from_bf16_bits, unavailable
from harness import InProcessService
from near_tie import assert_requests_like_mlx
from mlx_lm.models import gated_delta as mlx_gated_delta

from runtime.worker import engine as engine_module
from runtime.worker.model.discovery import discover
from runtime.worker.paths.cuda import gated_delta as gd
from runtime.worker.paths.cuda import gated_delta_check as gdc

UNAVAILABLE = unavailable()


def _data(name: str) -> str:
    return "reinterpret_cast<const bool*>(mask.data())" if name == "mask" else f"{name}.data()"


def _program(vectorized: bool, masked: bool, dk: int, dv: int, hk: int, hv: int) -> str:
    params = ["const bf16* q", "const bf16* k", "const bf16* v", "const float* g", "const bf16* beta",
              "const float* state_in"] + (["const bool* mask"] if masked else [])
    params += ["const int* q_shape", "bf16* y", "float* state_out"]
    kernel = ("template <typename InT, typename GT, typename BT, typename StT, int Dk, int Dv, int Hk, int Hv>\n"
              f"void gated_delta({', '.join(params)}) {{\n{gd.source(vectorized, masked)}\n}}\n")
    names = gd.input_names(masked)
    types = {"q": "bf16", "k": "bf16", "v": "bf16", "g": "float", "beta": "bf16", "state_in": "float", "mask": "unsigned char"}
    main = ["int main() {", "    int dims[2];  // rows, tokens", "    if (fread(dims, sizeof(int), 2, stdin) != 2) return 1;",
            "    const int B = dims[0], T = dims[1];", f"    const int q_shape[4] = {{B, T, {hk}, {dk}}};"]
    main += [f"    const auto {n} = read_array<{types[n]}>();" for n in names]
    main += [f"    std::vector<bf16> y(B * T * {hv} * {dv});", "    std::vector<float> state_out(state_in.size());",
             f"    launch(B * {hv} * ({dv} / {gd.WARPS}), {gd.WARPS * 32}, [&] {{ gated_delta<bf16, float, bf16, float, "
             f"{dk}, {dv}, {hk}, {hv}>({', '.join(_data(n) for n in names)}, q_shape, y.data(), state_out.data()); }});",
             "    write_array(y);", "    write_array(state_out);", "    return 0;", "}"]
    return STUBS + kernel + RUNNER + "\n".join(main) + "\n"


def _simulate(vectorized: bool, masked: bool, batch=2, steps=23, hk=2, hv=4, dk=64, dv=8, seed=0, keep=None):
    """The simulated kernel's and mlx-lm's ops path's (y, state) on the same random prompt
    (``keep``: its first tokens only), and the state before it."""
    rng = np.random.default_rng(seed)
    q = from_bf16_bits(bf16_bits(rng.standard_normal((batch, steps, hk, dk)) * dk**-0.5))
    k = from_bf16_bits(bf16_bits(rng.standard_normal((batch, steps, hk, dk)) * dk**-0.5))
    v = from_bf16_bits(bf16_bits(rng.standard_normal((batch, steps, hv, dv))))
    g = np.exp(-np.exp(rng.standard_normal((batch, steps, hv) + ((dk,) if vectorized else ())) - 2)).astype(np.float32)
    beta = from_bf16_bits(bf16_bits(1 / (1 + np.exp(-rng.standard_normal((batch, steps, hv))))))
    state = (rng.standard_normal((batch, hv, dv, dk)) * 0.1).astype(np.float32)
    mask = np.arange(steps)[None, :] < np.array([[steps], [steps - 4]]) if masked else None
    if keep is not None:
        q, k, v, g, beta, steps = q[:, :keep], k[:, :keep], v[:, :keep], g[:, :keep], beta[:, :keep], keep
    arrays = {"q": bf16_bits(q), "k": bf16_bits(k), "v": bf16_bits(v), "g": g, "beta": bf16_bits(beta), "state_in": state,
              "mask": mask}
    stdin = [np.array([batch, steps], np.int32).tobytes()]
    for name in gd.input_names(masked):
        a = arrays[name]
        stdin += [np.array([a.size], np.int64).tobytes(), np.ascontiguousarray(a).tobytes()]
    ran = subprocess.run([str(binary(_program(vectorized, masked, dk, dv, hk, hv)))], input=b"".join(stdin),
                         capture_output=True, check=True, timeout=120)
    out = np.frombuffer(ran.stdout, np.float32)
    y, new_state = out[: batch * steps * hv * dv].reshape(batch, steps, hv, dv), out[batch * steps * hv * dv:]
    want_y, want_state = mlx_gated_delta.gated_delta_ops(
        mx.array(q, dtype=mx.bfloat16), mx.array(k, dtype=mx.bfloat16), mx.array(v, dtype=mx.bfloat16),
        mx.array(g), mx.array(beta, dtype=mx.bfloat16), mx.array(state), None if mask is None else mx.array(mask))
    return y, new_state.reshape(state.shape), np.array(want_y.astype(mx.float32)), np.array(want_state), state


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"cannot simulate the CUDA kernels: {UNAVAILABLE}")
@pytest.mark.parametrize(("vectorized", "masked"), [(False, False), (False, True), (True, False)])
def test_the_kernel_source_matches_mlx_lms_ops_path(vectorized, masked):
    # Two value heads per key head, several blocks per head: each lane's slice of each state row.
    y, state, want_y, want_state, before = _simulate(vectorized, masked)
    assert np.abs(state - want_state).max() < 1e-5 * max(1.0, np.abs(want_state).max())
    assert np.abs(y - want_y).max() < 2e-2 * max(1.0, np.abs(want_y).max())  # bf16 outputs: a rounding apart
    assert np.abs(state - before).max() > 1e-2  # the prompt moved the state
    if masked:  # row 1's last 4 positions are padding: its state is the one after position 18
        _, state_18, _, want_18, _ = _simulate(vectorized, False, keep=19)
        assert np.abs(state[1] - state_18[1]).max() < 1e-6 and np.abs(want_state[1] - want_18[1]).max() < 1e-6


@pytest.mark.skipif(UNAVAILABLE is not None, reason=f"cannot simulate the CUDA kernels: {UNAVAILABLE}")
def test_the_kernel_source_takes_a_decode_steps_one_token():
    y, state, want_y, want_state, before = _simulate(False, False, batch=3, steps=1)
    assert np.abs(state - want_state).max() < 1e-5 * max(1.0, np.abs(want_state).max())
    assert np.abs(y - want_y).max() < 2e-2 * max(1.0, np.abs(want_y).max())
    assert np.abs(state - before).max() > 1e-3  # the token moved the state


def test_the_scope_puts_the_kernel_in_the_ops_paths_place_and_refuses_nesting():
    original = mlx_gated_delta.gated_delta_ops
    prefill = gd.GatedDeltaKernel(True)
    with prefill.scope():
        assert mlx_gated_delta.gated_delta_ops is prefill
        with pytest.raises(RuntimeError, match="nest"), gd.GatedDeltaKernel(True).scope():
            pass
        assert mlx_gated_delta.gated_delta_ops is prefill
    assert mlx_gated_delta.gated_delta_ops is original
    with gd.GatedDeltaKernel(False).scope():  # not used: mlx-lm stays as shipped
        assert mlx_gated_delta.gated_delta_ops is original
    # Shapes the kernel does not take go to the ops path.
    q = mx.zeros((1, 3, 2, 48))  # 48 key dims: not whole warps of lanes
    assert not prefill.applies(q, q, mx.zeros((1, 3, 2, 8)), mx.zeros((1, 3, 2)), mx.zeros((1, 3, 2)), None)
    q, v, g = mx.zeros((1, 3, 2, 64)), mx.zeros((1, 3, 2, 8)), mx.zeros((1, 3, 2))
    assert prefill.applies(q, q, v, g, g, mx.zeros((1, 2, 8, 64)))
    assert not prefill.applies(q, q, v, g, g, mx.zeros((1, 2, 64, 8)))  # a state of other widths
    assert not prefill.applies(q, q, v, mx.zeros((1, 3, 2, 32)), g, None)  # a decay of other columns
    assert not prefill.applies(q, q, v.astype(mx.float16), g, g, None)  # v of another dtype than q's


def test_the_workers_prefill_and_decode_run_inside_the_scope(model_dir, monkeypatch):
    """On a GPU the kernel; here a stand-in that counts its calls and returns the ops path's
    results, so the prefill's tokens stay mlx-lm's (the service's own exactness tests hold)."""
    calls = []

    def stand_in(self, q, k, v, g, beta, state=None, mask=None):
        calls.append(q.shape[1])
        return gd.ops_path(q, k, v, g, beta, state, mask)

    monkeypatch.setattr(gd.GatedDeltaKernel, "__call__", stand_in)
    monkeypatch.setattr(engine_module, "kernel_for", lambda model, layout, on_cuda: gd.GatedDeltaKernel(True))
    svc = InProcessService(model_dir("qwen3_next"), max_running=4, aux_slots=16)
    req = svc.request("r0", list(range(3, 40)), 4)
    svc.run({0: [req]})
    assert calls and max(calls) > 1  # prompt chunks of many tokens went through it
    assert 1 in calls  # and decode steps (their one token, as traced or built)
    assert mlx_gated_delta.gated_delta_ops is gd._mlx_gated_delta_ops
    assert_requests_like_mlx(model_dir("qwen3_next"), [req])


def test_which_models_take_the_kernel(model_dir, monkeypatch):
    from mlx_lm.utils import load_model

    qwen, llama = load_model(model_dir("qwen3_next"))[0], load_model(model_dir("llama"))[0]
    qwen_layout, llama_layout = discover(qwen), discover(llama)
    assert not gdc.kernel_for(qwen, qwen_layout, on_cuda=False).use_kernel  # not on a CPU
    checked = []
    monkeypatch.setattr(gdc, "check", lambda kernel, calls: checked.append(calls))
    assert gdc.kernel_for(qwen, qwen_layout, on_cuda=True).use_kernel
    assert checked == [gdc.model_calls(qwen, qwen_layout)]  # checked at the model's own calls
    assert not gdc.kernel_for(llama, llama_layout, on_cuda=True).use_kernel  # no delta-net layers
    monkeypatch.setattr(gdc, "check", lambda kernel, calls: "the output differs")
    dropped = gdc.kernel_for(qwen, qwen_layout, on_cuda=True)
    assert not dropped.use_kernel and dropped.problem == "the output differs"


@pytest.mark.parametrize(("arch", "vectorized", "widths"), [("qwen3_next", False, ("head_k_dim", "head_v_dim")),
                                                         ("kimi_linear", True, ("head_dim", "head_dim"))])
def test_the_check_takes_the_calls_the_models_forwards_make(model_dir, arch, vectorized, widths):
    from mlx_lm.utils import load_model

    model = load_model(model_dir(arch))[0]
    calls = gdc.model_calls(model, discover(model))
    assert calls != gdc.SMALL
    # A padded prompt's call is masked, a decode step's and an unpadded prompt's are not.
    assert {c.masked for c in calls} == {True, False}
    assert {c.vectorized for c in calls} == {vectorized}
    assert mlx_gated_delta.gated_delta_ops is gd._mlx_gated_delta_ops  # put back
    delta = next(m for m in model.modules() if "A_log" in m)  # a delta-net layer: its widths
    assert {(c.dk, c.dv) for c in calls} == {(getattr(delta, widths[0]), getattr(delta, widths[1]))}


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on a CUDA GPU")
@pytest.mark.parametrize("vectorized", [False, True])
@pytest.mark.parametrize("batch,steps", [(2, 300), (16, 1)])  # a prompt; a decode step of 16 rows
def test_the_kernel_on_a_gpu_matches_the_ops_path_at_qwen3_next_widths(vectorized, batch, steps):
    prefill = gd.GatedDeltaKernel(True)
    assert gdc.check(prefill, gdc.SMALL) is None
    key = mx.random.split(mx.random.key(3), 6)
    hk, hv, dk, dv = 16, 32, 128, 128
    q = (mx.random.normal((batch, steps, hk, dk), key=key[0]) * dk**-0.5).astype(mx.bfloat16)
    k = (mx.random.normal((batch, steps, hk, dk), key=key[1]) * dk**-0.5).astype(mx.bfloat16)
    v = mx.random.normal((batch, steps, hv, dv), key=key[2]).astype(mx.bfloat16)
    g = mx.exp(-mx.exp(mx.random.normal((batch, steps, hv) + ((dk,) if vectorized else ()), key=key[3]) - 2))
    beta = mx.sigmoid(mx.random.normal((batch, steps, hv), key=key[4])).astype(mx.bfloat16)
    y, state = prefill(q, k, v, g, beta, None)
    want_y, want_state = gd.ops_path(q, k, v, g, beta, None)
    assert mx.abs(state - want_state).max().item() < 1e-4 * max(1.0, mx.abs(want_state).max().item())
    assert mx.abs(y.astype(mx.float32) - want_y.astype(mx.float32)).max().item() < 2e-2 * max(
        1.0, mx.abs(want_y.astype(mx.float32)).max().item())


@pytest.mark.skipif(not mx.cuda.is_available(), reason="the kernel runs on a CUDA GPU")
def test_the_start_up_check_passes_at_a_models_own_calls(model_dir):
    from mlx_lm.utils import load_model

    model = load_model(model_dir("qwen3_next"))[0]
    kernel = gdc.kernel_for(model, discover(model), on_cuda=True)
    assert kernel.use_kernel and kernel.problem is None
