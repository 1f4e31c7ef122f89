"""Our CUDA kernels as CUBINs on disk (``paths/cuda/cubin_kernels``): the translation units the
store builds compile with NVRTC (pip's, on a machine without a GPU), the store reads a unit back
instead of building it again, and the int arguments a launch passes are the ones the unit
declares, in its order. Launching them is the GPU's to check (``PRECOMPILE`` is off until then).
"""

from __future__ import annotations

import re

import mlx.core as mx
import pytest

from runtime.worker.paths.cuda import add_rms_norm, cubin_kernels, paged_kernels
from runtime.worker.paths.cuda.kernel_launch import lanes_per_position

CUDA = cubin_kernels.cuda_folder()
needs_nvrtc = pytest.mark.skipif(CUDA is None or cubin_kernels.find_nvrtc() is None,
                                 reason="NVRTC and the CUDA headers from pip (nvidia-cuda-nvrtc, nvidia-cuda-cccl) "
                                        "are not installed")
_NDIMS = {"queries": 4, "keys": 3, "values": 3, "table": 2, "rows": 1, "lengths": 1, "tail_keys": 4,
          "tail_values": 4, "tail_len": 1, "new_keys": 4, "new_values": 4, "scale": 1, "positions": 1,
          "rope_consts": 1, "rope_freqs": 1, "part_acc": 1, "part_m": 1, "part_l": 1}


def _dtype(name: str) -> mx.Dtype:
    if name in ("table", "rows", "lengths", "tail_len", "positions"):
        return mx.int32
    return mx.float32 if name in ("scale", "rope_consts", "rope_freqs") or name.startswith("part") else mx.bfloat16


def _store(tmp_path) -> cubin_kernels.CubinStore:
    nvrtc = cubin_kernels.Nvrtc(cubin_kernels.find_nvrtc())
    return cubin_kernels.CubinStore(tmp_path / "cubin", nvrtc, "sm_90", cubin_kernels.include_folders({}))


def _paged(kind: str, loop: str, rope: bool) -> tuple[str, str, list[str], list[str], list]:
    inputs = paged_kernels.ROPE_INPUTS if rope else paged_kernels.APPEND_INPUTS
    outputs = (["out"] if kind == "single" else ["part_acc", "part_m", "part_l"]) + paged_kernels.APPEND_OUTPUTS
    source = paged_kernels.body(True, loop, rope) + (paged_kernels.WRITE_OUT if kind == "single"
                                                     else paged_kernels.WRITE_PARTIAL)
    template = [("T", mx.bfloat16), ("D", 128), ("NREP", 4), ("HKV", 8), ("NWARPS", 4), ("UNROLL", 1),
                ("GL", lanes_per_position(128))]
    if rope:
        template += [("ROPE", 1), ("ROPE_DIMS", 128), ("ROPE_TRAD", False)]
    return source, paged_kernels.HEADER, inputs, outputs, template


def _unit(source, header, inputs, outputs, template, func="runtime_test") -> str:
    return cubin_kernels.translation_unit(func, source, header, inputs, [_dtype(n) for n in inputs],
                                          [_NDIMS[n] for n in inputs], outputs, [_dtype(n) for n in outputs], template)


@needs_nvrtc
@pytest.mark.parametrize(("kind", "loop", "rope"), [("split", "mma_ahead", True), ("single", "mma", True),
                                                    ("single", "pipelined", False)])
def test_the_paged_kernels_build_as_cubins(tmp_path, kind, loop, rope):
    store = _store(tmp_path)
    cubin, log = store.cubin(_unit(*_paged(kind, loop, rope)))
    assert cubin[:4] == b"\x7fELF", log[:3000]


@needs_nvrtc
def test_the_combine_and_the_fused_norm_build_as_cubins(tmp_path):
    store = _store(tmp_path)
    combine = _unit(paged_kernels.COMBINE, "", ["part_acc", "part_m", "part_l"], ["out"],
                    [("T", mx.bfloat16), ("D", 128), ("NREP", 4)])
    assert store.cubin(combine)[0][:4] == b"\x7fELF"
    norm = cubin_kernels.translation_unit(
        "runtime_norm", add_rms_norm.SOURCE, add_rms_norm.HEADER, ["x", "r", "w", "eps"],
        [mx.bfloat16, mx.bfloat16, mx.bfloat16, mx.float32], [2, 2, 1, 1], ["h", "out"], [mx.bfloat16] * 2,
        [("T", mx.bfloat16), ("BLOCK", 128), ("CHUNKS", 4), ("N", 4096)])
    cubin, log = store.cubin(norm)
    assert cubin[:4] == b"\x7fELF", log[:3000]


@needs_nvrtc
def test_a_unit_built_once_is_read_back_from_disk(tmp_path):
    unit = _unit(paged_kernels.COMBINE, "", ["part_acc", "part_m", "part_l"], ["out"],
                 [("T", mx.bfloat16), ("D", 64), ("NREP", 2)])
    first = _store(tmp_path)
    cubin, _ = first.cubin(unit)
    assert first.built == 1 and cubin
    again = _store(tmp_path)  # a later start: the same folder
    assert again.cubin(unit)[0] == cubin and (again.built, again.read) == (0, 1)
    other = unit.replace("constexpr int NREP = 2;", "constexpr int NREP = 4;")
    assert again.key(other) != again.key(unit)
    again.cubin(other)
    assert again.built == 1
    (tmp_path / "cubin" / f"{again.key(unit)}.cubin").write_bytes(b"torn")  # not a CUBIN: built again
    assert again.cubin(unit)[0][:4] == b"\x7fELF" and again.built == 2


@needs_nvrtc
def test_a_unit_that_does_not_build_gives_no_cubin_and_its_log(tmp_path):
    cubin, log = _store(tmp_path).cubin(cubin_kernels.PRELUDE + 'extern "C" __global__ void k() { undefined(); }')
    assert cubin == b"" and "undefined" in log


def test_the_shape_arguments_follow_the_declared_ints():
    source, header, inputs, outputs, template = _paged("split", "mma_ahead", True)
    unit = _unit(source, header, inputs, outputs, template)
    start = unit.index('extern "C"')
    signature = unit[start:unit.index(") {", start)]
    declared = re.findall(r"int (\w+)_shape_(\d+)", signature)
    arrays = [mx.zeros(tuple(range(2, 2 + _NDIMS[n])), dtype=_dtype(n)) for n in inputs]
    values = cubin_kernels.shape_arguments(cubin_kernels.shaped_inputs(source, inputs), arrays)
    assert [int(d) + 2 for _, d in declared] == values  # each input's dims, in the order declared
    assert {n for n, _ in declared} == {n for n in inputs if re.search(rf"\b{n}_shape\b", source)}
    assert "keys" not in {n for n, _ in declared}  # ``tail_keys_shape`` is not ``keys_shape``
    assert signature.index("int ") > signature.index(outputs[-1])  # after every pointer: MLX's scalar order


def test_the_template_becomes_constants():
    unit = cubin_kernels.translation_unit("k", "", "", ["x"], [mx.float16], [1], ["y"], [mx.float32],
                                          [("T", mx.bfloat16), ("FLAG", True), ("N", 7)])
    assert "using T = __nv_bfloat16;" in unit and "constexpr bool FLAG = true;" in unit
    assert "constexpr int N = 7;" in unit and "const __half* x" in unit and "float* y" in unit


def test_mlx_builds_the_kernel_while_precompile_is_off_or_the_source_reads_strides(monkeypatch, tmp_path):
    made = []
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: made.append(kw["name"]) or "mlx")
    assert cubin_kernels.cuda_kernel(name="a", input_names=["x"], output_names=["y"], source="y[0] = x[0];") == "mlx"
    monkeypatch.setattr(cubin_kernels, "PRECOMPILE", True)
    store = object.__new__(cubin_kernels.CubinStore)
    monkeypatch.setattr(cubin_kernels, "default_store", lambda: store)
    kernel = cubin_kernels.cuda_kernel(name="b", input_names=["x"], output_names=["y"], source="y[0] = x[0];")
    assert isinstance(kernel, cubin_kernels.CubinKernel) and kernel.store is store
    assert cubin_kernels.cuda_kernel(name="c", input_names=["x"], output_names=["y"],
                                     source="y[0] = x_strides[0];") == "mlx"
    assert made == ["a", "c"]


@needs_nvrtc
def test_prefetched_units_build_on_threads_to_the_same_bits(tmp_path):
    units = [_unit(paged_kernels.COMBINE, "", ["part_acc", "part_m", "part_l"], ["out"],
                   [("T", mx.bfloat16), ("D", d), ("NREP", r)]) for d in (64, 128) for r in (1, 2)]
    ahead = cubin_kernels.CubinStore(tmp_path / "ahead", _store(tmp_path).nvrtc, "sm_90",
                                     cubin_kernels.include_folders({}), threads=4)
    for unit in units + units[:1]:  # a unit already under way is not started twice
        ahead.prefetch(unit)
    assert len(ahead._pending) == len(units)
    built = [ahead.cubin(unit)[0] for unit in units]
    assert ahead.built == len(units) and not ahead._pending  # each build waited for, none run again
    one_by_one = _store(tmp_path / "serial")
    assert built == [one_by_one.cubin(unit)[0] for unit in units]  # threads give NVRTC's own bits
    again = cubin_kernels.CubinStore(tmp_path / "ahead", ahead.nvrtc, "sm_90", cubin_kernels.include_folders({}))
    again.prefetch(units[0])  # on disk: nothing to start
    assert not again._pending and again.cubin(units[0])[0] == built[0] and again.read == 1


@needs_nvrtc
def test_a_deferred_launch_starts_its_build_and_returns_zeros(tmp_path):
    store = _store(tmp_path)
    kernel = cubin_kernels.CubinKernel("runtime_combine", ["part_acc", "part_m", "part_l"], ["out"],
                                       paged_kernels.COMBINE, "", store)
    inputs = [mx.ones((4 * 64,)), mx.ones((4,)), mx.ones((4,))]
    template = [("T", mx.bfloat16), ("D", 64), ("NREP", 1)]
    with store.deferred():
        (out,) = kernel(inputs=inputs, template=template, grid=(256, 1, 1), threadgroup=(64, 1, 1),
                        output_shapes=[(1, 2, 1, 64)], output_dtypes=[mx.bfloat16])
        with pytest.raises(AssertionError):
            with store.deferred():
                pass
    assert out.shape == (1, 2, 1, 64) and out.dtype == mx.bfloat16 and not mx.any(out).item()
    assert len(store._pending) == 1 and not store.deferring
    func, cubin = kernel.variant([a.dtype for a in inputs], [1, 1, 1], [mx.bfloat16], template)
    assert cubin[:4] == b"\x7fELF" and func.startswith("runtime_combine_")
    assert store.built == 1 and not store._pending  # the launch took the prefetched build


def test_nothing_is_prefetched_while_precompile_is_off(monkeypatch):
    monkeypatch.setattr(cubin_kernels, "PRECOMPILE", False)
    with cubin_kernels.prefetching() as ahead:
        assert ahead is False


@needs_nvrtc
def test_a_deferred_warm_up_starts_one_build_per_kernel_it_would_launch(tmp_path, monkeypatch):
    from runtime.worker.paths import paged_attention

    store = _store(tmp_path)
    monkeypatch.setattr(cubin_kernels, "PRECOMPILE", True)
    monkeypatch.setattr(cubin_kernels, "default_store", lambda: store)
    monkeypatch.setattr(paged_attention, "_tensor_cores", lambda: True)
    attention = paged_attention.PagedAttention(True, loop="mma", split_registers=0)
    with cubin_kernels.prefetching() as ahead:
        assert ahead
        # (splits, warps): one unsplit launch, two split ones whose mma blocks both take 4 warps
        attention.warm_up(mx.bfloat16, 8, 4, 128, {(1, 4), (4, 4), (8, 8)})
    assert sorted(k[0] for k in attention._kernels) == ["combine", "single", "split"]
    assert len(store._pending) == 3 and store.built <= 3  # one build each, started, none launched
    for future in list(store._pending.values()):
        assert future.result()[0][:4] == b"\x7fELF"
