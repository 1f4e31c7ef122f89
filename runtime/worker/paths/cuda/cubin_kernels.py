"""Our CUDA kernels compiled once to machine code (CUBIN) and kept on disk.

MLX's ``mx.fast.cuda_kernel`` runs NVRTC on a kernel's source at the first launch in every
process: MLX keeps custom kernels in memory only (its disk cache holds its own kernels). The
paged decode kernels, their combine and the fused add + norm are a few NVRTC seconds each, at
every start of the worker. This module's ``cuda_kernel`` returns a callable with
``mx.fast.cuda_kernel``'s call signature that, where ``PRECOMPILE`` is on and NVRTC can be
loaded, builds the translation unit itself (the template arguments as constants, each
``NAME_shape`` the source reads as int arguments), compiles it once per variant with the
process's NVRTC, keeps the CUBIN under the kernel cache folder (keyed by a hash of the unit,
the options and NVRTC's version) and launches it with ``mx.fast.precompiled_cuda_kernel``.
Anything it cannot do falls back to MLX's own build.

A warm-up pass run under ``CubinStore.deferred()`` launches nothing: each launch hands its unit
to a pool of NVRTC threads (ctypes lets go of the GIL while NVRTC compiles) and returns zeros,
so the real pass after it waits for builds that ran side by side, not one after another.

``PRECOMPILE`` stays off until a GPU run has shown the launches right (the start-up checks of
``kernel_check`` and ``AddRmsNorm.check`` compare every kernel with MLX's own operations).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import re
import sys
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

PRECOMPILE = False
CACHE_SUBDIR = "runtime-cubin"
_CUDA_TYPES = {mx.bfloat16: "__nv_bfloat16", mx.float16: "__half", mx.float32: "float", mx.int32: "int",
               mx.uint32: "unsigned int", mx.bool_: "bool", mx.int64: "long long", mx.uint8: "unsigned char"}
# What MLX's wrapper gives every custom kernel that ours use: the 16-bit float types,
# cooperative groups (as ``cg``), ``INFINITY`` and ``inf``.
PRELUDE = ("#include <cuda_bf16.h>\n#include <cuda_fp16.h>\n#include <cooperative_groups.h>\n"
           "#ifndef INFINITY\n#define INFINITY __int_as_float(0x7f800000)\n#endif\n#define inf INFINITY\n")


def cuda_type(dtype: mx.Dtype) -> str:
    """The CUDA spelling of an MLX dtype (KeyError for one our kernels never take)."""
    return _CUDA_TYPES[dtype]


def translation_unit(func: str, source: str, header: str, input_names: Sequence[str],
                     input_dtypes: Sequence[mx.Dtype], input_ndims: Sequence[int], output_names: Sequence[str],
                     output_dtypes: Sequence[mx.Dtype], template: Sequence[tuple[str, object]]) -> str:
    """The kernel as one ``extern "C"`` function: input pointers, output pointers, then one int
    per dimension of each input whose ``NAME_shape`` the source reads (``shape_arguments``
    gives their values in this order), rebuilt as a local array under that name."""
    params = [f"const {cuda_type(dt)}* {name}" for name, dt in zip(input_names, input_dtypes)]
    params += [f"{cuda_type(dt)}* {name}" for name, dt in zip(output_names, output_dtypes)]
    locals_ = []
    for i in shaped_inputs(source, input_names):  # the order ``shape_arguments`` passes them in
        name, ndim = input_names[i], input_ndims[i]
        dims = [f"{name}_shape_{d}" for d in range(ndim)]
        params += [f"int {d}" for d in dims]
        locals_.append(f"    const int {name}_shape[{max(ndim, 1)}] = {{{', '.join(dims) or '0'}}};")
    constants = []
    for name, value in template:
        if isinstance(value, mx.Dtype):
            constants.append(f"    using {name} = {cuda_type(value)};")
        elif isinstance(value, bool):
            constants.append(f"    constexpr bool {name} = {str(value).lower()};")
        else:
            constants.append(f"    constexpr int {name} = {int(value)};")
    return (PRELUDE + header + "namespace cg = cooperative_groups;\n\n"
            f'extern "C" __global__ void {func}(\n    ' + ",\n    ".join(params) + ") {\n"
            + "\n".join(constants + locals_) + "\n" + source + "\n}\n")


def shaped_inputs(source: str, input_names: Sequence[str]) -> tuple[int, ...]:
    """The indices of the inputs whose ``NAME_shape`` the source reads."""
    return tuple(i for i, name in enumerate(input_names) if _reads_shape(source, name))


def shape_arguments(shaped: Sequence[int], inputs: Sequence[mx.array]) -> list[int]:
    """The int arguments ``translation_unit`` declares: each ``shaped`` input's dimensions."""
    return [int(n) for i in shaped for n in inputs[i].shape]


def _reads_shape(source: str, name: str) -> bool:
    return re.search(rf"\b{re.escape(name)}_shape\b", source) is not None


def uses_unsupported(source: str, input_names: Sequence[str]) -> bool:
    """Whether the source reads what only MLX's wrapper passes (strides, ndim)."""
    return any(re.search(rf"\b{re.escape(n)}_(strides|ndim)\b", source) for n in input_names)


class Nvrtc:
    """The NVRTC calls a build needs, through ctypes (the library MLX itself loaded)."""

    def __init__(self, library: str) -> None:
        self.lib = ctypes.CDLL(library)
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"

    def compile(self, source: str, options: list[str]) -> tuple[bytes, str]:
        """(the CUBIN, b"" if the build failed; NVRTC's log)."""
        prog = ctypes.c_void_p()
        if self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), b"kernel.cu", 0, None, None):
            return b"", "nvrtcCreateProgram failed"
        try:
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            self.lib.nvrtcGetProgramLog(prog, log)
            if result != 0:
                return b"", log.value.decode(errors="replace")
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetCUBIN(prog, cubin)
            return cubin.raw, log.value.decode(errors="replace")
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


def find_nvrtc() -> str | None:
    """The NVRTC library to load: the one already in the process (MLX's), else pip's."""
    for name in ("libnvrtc.so.13", "libnvrtc.so.12"):
        try:
            ctypes.CDLL(name, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)  # only if already loaded
            return name
        except OSError:
            continue
    folder = cuda_folder()
    if folder is not None:
        found = sorted((folder / "lib").glob("libnvrtc.so.*"))
        if found:
            return str(found[0])
    return None


def cuda_folder() -> Path | None:
    """pip's CUDA 13 folder (``nvidia/cu13``: NVRTC, the runtime's headers, CCCL), or None."""
    for root in (Path(p) for p in sys.path if p):
        folder = root / "nvidia" / "cu13"
        if (folder / "include" / "cuda_bf16.h").exists():
            return folder
    return None


def include_folders(env: dict[str, str] | os._Environ) -> list[Path]:
    """Where the CUDA and CCCL headers are: MLX's bundled CCCL, pip's CUDA folder, CUDA_HOME."""
    folders = [Path(mx.__file__).parent / "include" / "cccl"]
    pip = cuda_folder()
    if pip is not None:
        folders += [pip / "include", pip / "include" / "cccl"]
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            folders.append(Path(env[var]) / "include")
    folders.append(Path("/usr/local/cuda/include"))
    return [f for f in folders if f.is_dir()]


class CubinStore:
    """CUBINs on disk by content hash: a unit built once is read back by every later start.
    ``prefetch`` starts a unit's build on a thread; ``cubin`` then waits for it."""

    def __init__(self, folder: Path | None, nvrtc: Nvrtc, arch: str, includes: list[Path], threads: int = 0) -> None:
        self.folder = folder
        self.nvrtc = nvrtc
        self.options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
                        *[f"--include-path={p}" for p in includes]]
        self.built = 0  # units compiled by NVRTC in this process
        self.read = 0  # units read back from the folder
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.deferring = False  # inside ``deferred()``: launches only prefetch their units
        self._lock = threading.Lock()  # the counters, from the build threads
        self._pending: dict[str, Future[tuple[bytes, str]]] = {}
        self._executor: ThreadPoolExecutor | None = None

    def key(self, unit: str) -> str:
        digest = hashlib.sha256("\0".join([unit, *self.options, self.nvrtc.version]).encode())
        return digest.hexdigest()[:20]

    def _path(self, unit: str) -> Path | None:
        return self.folder / f"{self.key(unit)}.cubin" if self.folder is not None else None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Launches inside only start their units' builds (``CubinKernel`` returns zeros); not nestable."""
        assert not self.deferring, "deferred() does not nest"
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def prefetch(self, unit: str) -> None:
        """Start building ``unit`` on a thread, unless it is on disk or already under way."""
        key = self.key(unit)
        path = self._path(unit)
        if key in self._pending or (path is not None and path.is_file()):
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="runtime-nvrtc")
        self._pending[key] = self._executor.submit(self._build, unit, path)

    def cubin(self, unit: str) -> tuple[bytes, str]:
        """(the unit's CUBIN, b"" if it does not build; the build log or "")."""
        future = self._pending.pop(self.key(unit), None)
        if future is not None:
            return future.result()
        path = self._path(unit)
        if path is not None and path.is_file():
            data = path.read_bytes()
            if data[:4] == b"\x7fELF":
                self.read += 1
                return data, ""
        return self._build(unit, path)

    def _build(self, unit: str, path: Path | None) -> tuple[bytes, str]:
        """NVRTC's build of ``unit``, written to ``path`` (on a build thread or the caller's)."""
        data, log = self.nvrtc.compile(unit, self.options)
        with self._lock:
            self.built += 1
        if data and path is not None:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                partial = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.part")
                partial.write_bytes(data)
                partial.replace(path)  # whole or absent: a reader never sees half a file
            except OSError:
                pass  # a cache that cannot be written costs the next start a build, nothing else
        return data, log


class CubinKernel:
    """``mx.fast.cuda_kernel``'s callable, launching CUBINs from a ``CubinStore`` (one per
    template, dtypes and ranks of the inputs); a variant that does not build takes MLX's path."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str,
                 store: CubinStore) -> None:
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.store = store
        self.shaped = shaped_inputs(source, input_names)  # once: the launch is on the decode step's path
        self._variants: dict[tuple, tuple[str, bytes] | None] = {}
        self._mlx = None

    def variant(self, input_dtypes: Sequence[mx.Dtype], input_ndims: Sequence[int], output_dtypes: Sequence[mx.Dtype],
                template: Sequence[tuple[str, object]]) -> tuple[str, bytes] | None:
        """(the function's name, its CUBIN) for these arguments, or None where it did not build."""
        key = (tuple(input_dtypes), tuple(input_ndims), tuple(output_dtypes), tuple(template))
        if key not in self._variants:
            func, unit = self._unit(key)
            cubin, log = self.store.cubin(unit)
            if not cubin:
                print(f"runtime worker: {func} did not build as a CUBIN, MLX builds it instead: {log[:300]}",
                      file=sys.stderr, flush=True)
            self._variants[key] = (func, cubin) if cubin else None
        return self._variants[key]

    def _unit(self, key: tuple) -> tuple[str, str]:
        """(the function's name, its translation unit) for a ``variant`` key."""
        input_dtypes, input_ndims, output_dtypes, template = key
        func = f"{self.name}_{hashlib.sha256(repr((key, self.source, self.header)).encode()).hexdigest()[:16]}"
        return func, translation_unit(func, self.source, self.header, self.input_names, input_dtypes, input_ndims,
                                      self.output_names, output_dtypes, template)

    def __call__(self, *, inputs: Sequence[mx.array], template: Sequence[tuple[str, object]],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 output_shapes: Sequence[Sequence[int]], output_dtypes: Sequence[mx.Dtype]) -> list[mx.array]:
        if self.store.deferring:  # a prefetching pass: start the build, launch nothing
            key = (tuple(a.dtype for a in inputs), tuple(a.ndim for a in inputs), tuple(output_dtypes), tuple(template))
            if key not in self._variants:
                self.store.prefetch(self._unit(key)[1])
            return [mx.zeros(tuple(s), dtype=dt) for s, dt in zip(output_shapes, output_dtypes)]
        built = self.variant([a.dtype for a in inputs], [a.ndim for a in inputs], output_dtypes, template)
        if built is None:
            if self._mlx is None:
                self._mlx = mx.fast.cuda_kernel(name=self.name, input_names=self.input_names,
                                                output_names=self.output_names, source=self.source, header=self.header)
            return self._mlx(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                             output_shapes=output_shapes, output_dtypes=output_dtypes)
        func, cubin = built
        return mx.fast.precompiled_cuda_kernel(
            name=func, compiled_source=cubin, inputs=list(inputs), output_shapes=[tuple(s) for s in output_shapes],
            output_dtypes=list(output_dtypes), scalars=shape_arguments(self.shaped, inputs),
            grid=grid, threadgroup=threadgroup, ensure_row_contiguous=True)  # as cuda_kernel's default


@functools.cache
def default_store() -> CubinStore | None:
    """The worker's store: NVRTC as loaded in this process, this GPU's architecture, the
    folder beside MLX's kernel cache (``MLX_PTX_CACHE_DIR``, set by the worker); None where
    NVRTC cannot be loaded."""
    library = find_nvrtc()
    if library is None:
        return None
    try:
        nvrtc = Nvrtc(library)
    except OSError:
        return None
    info = mx.device_info()
    arch = f"sm_{info.get('compute_capability_major', 8)}{info.get('compute_capability_minor', 0)}"
    cache = os.environ.get("MLX_PTX_CACHE_DIR")
    return CubinStore(Path(cache) / CACHE_SUBDIR if cache else None, nvrtc, arch, include_folders(os.environ))


def cuda_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str = ""):
    """A custom kernel's callable (``mx.fast.cuda_kernel``'s call signature): from the CUBIN
    store where ``PRECOMPILE`` is on and it can serve this source, else MLX's own."""
    store = default_store() if PRECOMPILE else None
    if store is None or uses_unsupported(source, input_names):
        return mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                   source=source, header=header)
    return CubinKernel(name, input_names, output_names, source, header, store)


@contextlib.contextmanager
def prefetching() -> Iterator[bool]:
    """A pass whose launches of our kernels only start their NVRTC builds on threads (and
    return zeros), where the CUBIN store is in use; yields whether it is (if not, the caller
    should skip the pass: MLX's own builds cannot be started ahead)."""
    store = default_store() if PRECOMPILE else None
    if store is None:
        yield False
        return
    with store.deferred():
        yield True


def summary() -> str | None:
    """The start-up line's account of the store (None where it is not in use)."""
    store = default_store() if PRECOMPILE else None
    if store is None:
        return None
    where = f"kept in {store.folder}" if store.folder is not None else "kept in memory only"
    return f"our CUDA kernels: {store.built} built by NVRTC, {store.read} read back as CUBINs ({where})"
