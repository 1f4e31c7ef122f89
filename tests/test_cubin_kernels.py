"""Our CUDA kernels' modules written into MLX's kernel cache (``paths/cuda/cubin_kernels``,
``mlx_source``): the unit is MLX's wrapper of the kernel, the module is named and placed as
MLX looks for it, every kernel kind builds with NVRTC (pip's, on a machine without a GPU) and
the stand-in for MLX's device header, builds run side by side on threads, and a deferred
warm-up pass starts one build per kernel it would launch. That MLX loads what is written is
the GPU's to check (``test_cubin_kernels_cuda.py``; ``PRECOMPILE`` is off until then).
"""

from __future__ import annotations

import mlx.core as mx
import pytest

from runtime.worker.paths.cuda import add_rms_norm, cubin_kernels, mlx_source, paged_kernels
from runtime.worker.paths.cuda.kernel_launch import lanes_per_position
from runtime.worker.paths.cuda.nvrtc import Nvrtc, cuda_folder, find_nvrtc, include_folders, library_path

needs_nvrtc = pytest.mark.skipif(cuda_folder() is None or find_nvrtc() is None,
                                 reason="NVRTC and the CUDA headers from pip (nvidia-cuda-nvrtc, nvidia-cuda-cccl) "
                                        "are not installed")
_NDIMS = {"queries": 4, "keys": 3, "values": 3, "table": 2, "rows": 1, "lengths": 1, "tail_keys": 4,
          "tail_values": 4, "tail_len": 1, "new_keys": 4, "new_values": 4, "scale": 1, "positions": 1,
          "rope_consts": 1, "rope_freqs": 1, "part_acc": 1, "part_m": 1, "part_l": 1}


def _dtype(name: str) -> mx.Dtype:
    if name in ("table", "rows", "lengths", "tail_len", "positions"):
        return mx.int32
    return mx.float32 if name in ("scale", "rope_consts", "rope_freqs") or name.startswith("part") else mx.bfloat16


def _store(tmp_path, threads: int = 0, apart: bool = False) -> cubin_kernels.KernelStore:
    library = find_nvrtc()
    store = cubin_kernels.KernelStore(tmp_path / "ptx", Nvrtc(library), "sm_90a", include_folders({}), threads,
                                      library=library_path(library) if apart else "")
    store.verified = True  # MLX prints its unit only on a GPU
    return store


def _paged(kind: str, loop: str, rope: bool) -> tuple[str, str, list[str], list[str], list, str]:
    inputs = paged_kernels.ROPE_INPUTS if rope else paged_kernels.APPEND_INPUTS
    outputs = (["out"] if kind == "single" else ["part_acc", "part_m", "part_l"]) + paged_kernels.APPEND_OUTPUTS
    source = paged_kernels.body(True, loop, rope) + (paged_kernels.WRITE_OUT if kind == "single"
                                                     else paged_kernels.WRITE_PARTIAL)
    template = [("T", mx.bfloat16), ("D", 128), ("NREP", 4), ("HKV", 8), ("NWARPS", 4), ("UNROLL", 1),
                ("GL", lanes_per_position(128))]
    if rope:
        template += [("ROPE", 1), ("ROPE_DIMS", 128), ("ROPE_TRAD", False)]
    return source, paged_kernels.HEADER, inputs, outputs, template, f"runtime_paged_{kind}_{loop}"


def _unit(source, header, inputs, outputs, template, name) -> tuple[str, str]:
    func = mlx_source.kernel_name(name, template)
    return func, mlx_source.mlx_unit(func, header, source, inputs, [_dtype(n) for n in inputs],
                                     [_NDIMS[n] for n in inputs], outputs, [_dtype(n) for n in outputs], template)


def _combine(d: int = 128, n_rep: int = 4) -> tuple[str, str]:
    return _unit(paged_kernels.COMBINE, "", ["part_acc", "part_m", "part_l"], ["out"],
                 [("T", mx.bfloat16), ("D", d), ("NREP", n_rep)], "runtime_combine")


def test_std_hash_is_libstdcxx_hash_of_a_string():
    # std::hash<std::string> of g++ 13 / libstdc++ on x86-64 for these strings
    cases = {b"": 0x553E93901E462A6E, b"a": 0x454DDEE488C1ED6B, b"abcdefg": 0xDEEE6830A3AF82AF,
             b"abcdefgh": 0x783DB3E38DB898BB, b"abcdefghi": 0xB4EC9257851C8AAF,
             b"custom_kernel_x // \n source with 31 chars!": 0xF6273368858A8084,
             bytes((i * 131 + 7) & 255 for i in range(10000)): 0xF017A89A02693F47}
    for data, want in cases.items():
        assert mlx_source.std_hash(data) == want, data[:20]


def test_the_unit_is_mlx_wrapper_of_the_source():
    func = mlx_source.kernel_name("k", [("T", mx.bfloat16), ("FLAG", True), ("OFF", False), ("N", 7)])
    assert func == "custom_kernel_k_bfloat16_t_t_f_7"
    source = "y[0] = tail_x_shape[0] + x_ndim;"  # "x_shape" is in "tail_x_shape": MLX searches substrings
    unit = mlx_source.mlx_unit(func, "// mine\n", source, ["x", "tail_x", "s"], [mx.float16, mx.int32, mx.float32],
                               [2, 1, 0], ["y", "z"], [mx.float32, mx.bfloat16],
                               [("T", mx.bfloat16), ("FLAG", True), ("N", 7)])
    assert unit.startswith(mlx_source.DEFAULT_HEADER + "// mine\nnamespace mlx::core::cu {\n\n")
    params = unit[unit.index(f"__global__ void {func}(\n"):unit.index(") {\n")]
    assert params.splitlines()[1:] == [
        "    const __half* x,", "    const __grid_constant__ Shape x_shape,", "    const __grid_constant__ int x_ndim,",
        "    const int32_t* tail_x,", "    const __grid_constant__ Shape tail_x_shape,",
        "    const float* s,",  # rank 0: no shape even where named
        "    float* y,", "    __nv_bfloat16* z"]
    assert "  using T = __nv_bfloat16;\n  constexpr bool FLAG = true;\n  constexpr int N = 7;\n\n" + source in unit
    assert unit.endswith(source + "\n}\n\n} // namespace mlx::core::cu\n")
    assert mlx_source.module_name(func, unit) == f"{func}_{mlx_source.std_hash(unit.encode()):x}"


def test_module_paths_follow_mlx_long_name_folders(tmp_path):
    assert mlx_source.module_path(tmp_path, "short_1f") == tmp_path / "short_1f.ptx"
    long = "a" * 245 + "b" * 245 + "c" * 10
    assert mlx_source.module_path(tmp_path, long) == tmp_path / ("a" * 245) / ("b" * 245) / ("c" * 10 + ".ptx")


def test_printed_units_are_read_back():
    text = "Generated source code for `custom_kernel_k_4`:\n```\nline one\n\nline two\n\n```\n"
    assert mlx_source.printed_unit(text) == ("custom_kernel_k_4", "line one\n\nline two\n")
    assert mlx_source.printed_unit("nothing") is None


@needs_nvrtc
@pytest.mark.parametrize(("kind", "loop", "rope"), [("split", "mma_ahead", True), ("single", "mma", True),
                                                    ("single", "pipelined", False), ("split", "pipelined", False)])
def test_the_paged_kernels_build_into_mlx_cache(tmp_path, kind, loop, rope):
    store = _store(tmp_path)
    func, unit = _unit(*_paged(kind, loop, rope))
    assert store.prepare(func, unit), "the unit did not build"
    path = mlx_source.module_path(store.folder, mlx_source.module_name(func, unit))
    assert path.read_bytes()[:4] == b"\x7fELF"
    name, lowered = path.with_suffix(".txt").read_text().rstrip("\n").split("\t")
    assert name == "mlx::core::cu::" + func and lowered.startswith("_ZN3mlx4core2cu") and func in lowered
    assert (store.built, store.found, store.failed) == (1, 0, 0)


@needs_nvrtc
def test_the_combine_and_the_fused_norm_build_into_mlx_cache(tmp_path):
    store = _store(tmp_path)
    assert store.prepare(*_combine())
    norm_template = [("T", mx.bfloat16), ("BLOCK", 128), ("CHUNKS", 4), ("N", 4096)]
    func = mlx_source.kernel_name("runtime_add_rms_norm", norm_template)
    unit = mlx_source.mlx_unit(func, add_rms_norm.HEADER, add_rms_norm.SOURCE, ["x", "r", "w", "eps"],
                               [mx.bfloat16, mx.bfloat16, mx.bfloat16, mx.float32], [2, 2, 1, 1], ["h", "out"],
                               [mx.bfloat16] * 2, norm_template)
    assert store.prepare(func, unit) and store.built == 2


@needs_nvrtc
def test_a_module_on_disk_is_left_to_mlx_and_a_failed_build_to_mlx_too(tmp_path):
    first = _store(tmp_path)
    assert first.prepare(*_combine(64, 2)) and first.built == 1
    again = _store(tmp_path)  # a later start: the same folder
    assert again.prepare(*_combine(64, 2)) and (again.built, again.found) == (0, 1)
    func = mlx_source.kernel_name("broken", [])
    unit = mlx_source.mlx_unit(func, "", "undefined_call();", ["x"], [mx.float32], [1], ["y"], [mx.float32], [])
    assert not again.prepare(func, unit) and again.failed == 1
    assert not mlx_source.module_path(again.folder, mlx_source.module_name(func, unit)).exists()
    assert not list(again.folder.glob("*.part"))


@needs_nvrtc
def test_prefetched_units_build_in_processes_to_the_same_bits(tmp_path):
    units = [_combine(d, r) for d in (64, 128) for r in (1, 2)]
    ahead = _store(tmp_path / "ahead", threads=4, apart=True)
    for func, unit in units + units[:1]:  # a unit already under way is not started twice
        ahead.prefetch(func, unit)
    assert len(ahead._pending) == len(units)
    assert all(ahead.prepare(func, unit) for func, unit in units)
    assert ahead.built == len(units) and not ahead._pending  # each build waited for, none run again
    one_by_one = _store(tmp_path / "serial")
    for func, unit in units:
        module = mlx_source.module_name(func, unit)
        assert one_by_one.prepare(func, unit)
        assert (mlx_source.module_path(ahead.folder, module).read_bytes()
                == mlx_source.module_path(one_by_one.folder, module).read_bytes())  # NVRTC's bits, wherever built


@needs_nvrtc
def test_a_deferred_launch_starts_its_build_and_returns_zeros(tmp_path, monkeypatch):
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: None)  # MLX's own kernel is the GPU's
    store = _store(tmp_path)
    kernel = cubin_kernels.CachedKernel("runtime_combine", ["part_acc", "part_m", "part_l"], ["out"],
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
    func, unit = kernel.unit((tuple(a.dtype for a in inputs), (1, 1, 1), (mx.bfloat16,), tuple(template)))
    assert store.prepare(func, unit) and store.built == 1 and not store._pending  # the prefetched build


def test_nothing_is_prefetched_while_precompile_is_off(monkeypatch):
    monkeypatch.setattr(cubin_kernels, "PRECOMPILE", False)
    with cubin_kernels.prefetching() as ahead:
        assert ahead is False
    assert cubin_kernels.summary() is None


@needs_nvrtc
def test_a_deferred_warm_up_starts_one_build_per_kernel_it_would_launch(tmp_path, monkeypatch):
    from runtime.worker.paths import paged_attention

    store = _store(tmp_path)
    monkeypatch.setattr(cubin_kernels, "PRECOMPILE", True)
    monkeypatch.setattr(cubin_kernels, "default_store", lambda: store)
    monkeypatch.setattr(paged_attention, "_tensor_cores", lambda: True)
    monkeypatch.setattr(mx.fast, "cuda_kernel", lambda **kw: None)
    attention = paged_attention.PagedAttention(True, loop="mma", split_registers=0)
    with cubin_kernels.prefetching() as ahead:
        assert ahead
        # (splits, warps): one unsplit launch, two split ones whose mma blocks both take 4 warps
        attention.warm_up(mx.bfloat16, 8, 4, 128, {(1, 4), (4, 4), (8, 8)})
    assert sorted(k[0] for k in attention._kernels) == ["combine", "single", "split"]
    assert len(store._pending) == 3  # one build each, started, none launched
    assert all(future.result() for future in list(store._pending.values()))
    assert store.built == 3 and "3 built by NVRTC" in cubin_kernels.summary()


def test_the_store_is_used_only_where_mlx_prints_our_unit(tmp_path, monkeypatch):
    store = cubin_kernels.KernelStore(tmp_path, object(), "sm_90a", [])
    func, unit = "custom_kernel_k_4", "the unit\n"
    printed = f"Generated source code for `{func}`:\n```\n{unit}\n```\n"
    monkeypatch.setattr(cubin_kernels, "_stdout_of", lambda call: printed)
    assert cubin_kernels.verify(store, None, {}, func, unit) and store.mismatch is None
    other = cubin_kernels.KernelStore(tmp_path, object(), "sm_90a", [])
    assert not cubin_kernels.verify(other, None, {}, func, unit + "// MLX changed its wrapper\n")
    assert "differs" in other.mismatch and not cubin_kernels.verify(other, None, {}, func, unit)  # once a store

    def closed(call):
        raise OSError("Bad file descriptor")

    monkeypatch.setattr(cubin_kernels, "_stdout_of", closed)
    third = cubin_kernels.KernelStore(tmp_path, object(), "sm_90a", [])
    assert not cubin_kernels.verify(third, None, {}, func, unit) and "could not be read" in third.mismatch


def test_stdout_of_reads_what_is_written_to_descriptor_one():
    import os

    assert cubin_kernels._stdout_of(lambda: os.write(1, b"from C++ as it were\n")) == "from C++ as it were\n"


@needs_nvrtc
@pytest.mark.parametrize(("vectorized", "masked"), [(False, False), (False, True), (True, False)])
def test_the_delta_net_prefill_kernel_builds_into_mlx_cache(tmp_path, vectorized, masked):
    from runtime.worker.paths.cuda import gated_delta

    store = _store(tmp_path)
    template = [("InT", mx.bfloat16), ("GT", mx.float32), ("BT", mx.bfloat16), ("StT", mx.float32), ("Dk", 128),
                ("Dv", 128), ("Hk", 16), ("Hv", 32)]
    func = mlx_source.kernel_name(f"runtime_gated_delta{'_vec' if vectorized else ''}{'_mask' if masked else ''}",
                                  template)
    names = gated_delta.input_names(masked)
    dtypes = [mx.bfloat16] * 3 + [mx.float32, mx.bfloat16, mx.float32] + [mx.bool_] * masked
    ndims = [4, 4, 4, 4 if vectorized else 3, 3, 4] + [2] * masked
    unit = mlx_source.mlx_unit(func, "", gated_delta.source(vectorized, masked), names, dtypes, ndims,
                               ["y", "state_out"], [mx.bfloat16, mx.float32], template)
    assert store.prepare(func, unit) and (store.built, store.failed) == (1, 0)
