"""Our CUDA kernels' builds kept in MLX's own kernel cache, and made side by side.

MLX's ``mx.fast.cuda_kernel`` runs NVRTC on a kernel's unit at its first launch in every
process: for custom kernels MLX reads its disk cache but never writes it. The paged decode
kernels, their combine and the fused add + norm are a few NVRTC seconds each, at every start
of the worker. Where ``PRECOMPILE`` is on and NVRTC can be loaded, ``cuda_kernel`` returns a
callable with ``mx.fast.cuda_kernel``'s call signature that, before a variant's first launch,
writes the module MLX would build (``mlx_source``: the same unit, compiled with MLX's NVRTC
options) to the file MLX reads first. The launch itself stays MLX's own: no cost per launch.

A warm-up pass run under ``KernelStore.deferred()`` launches nothing: each launch hands its
unit to a build process (NVRTC compiles one program at a time a process; threads measured no
faster) and returns zeros, so the real pass after it waits for builds that ran side by side.

Anything that does not line up (a unit that does not build with the stand-in for MLX's device
header, an MLX whose wrapper no longer matches ``mlx_source``) leaves the build to MLX.
"""

from __future__ import annotations

import contextlib
import functools
import os
import sys
import tempfile
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import mlx.core as mx

from runtime.worker.paths.cuda import mlx_source
from runtime.worker.paths.cuda.nvrtc import Nvrtc, build_apart, find_nvrtc, include_folders, library_path

PRECOMPILE = True  # H100, session 30: MLX loaded the modules written, the start-up bit checks passed on them
# What our kernels need of MLX's device header (not shipped in its wheel): the float types, the
# Shape / Strides parameters of its wrapper (MAX_NDIM from the config.h the wheel does ship).
UTILS_STAND_IN = """#pragma once
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda/std/array>
#include <cuda/std/cstdint>
#include "mlx/backend/cuda/device/config.h"
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
namespace mlx::core::cu {
using Shape = cuda::std::array<int32_t, MAX_NDIM>;
using Strides = cuda::std::array<int64_t, MAX_NDIM>;
}
"""
UTILS = "mlx/backend/cuda/device/utils.cuh"
CONFIG = "mlx/backend/cuda/device/config.h"
CONFIG_STAND_IN = "#pragma once\n#define MAX_NDIM 10\n"  # only where MLX's own config.h is not installed


class KernelStore:
    """Modules written where MLX reads them (``mlx_source.module_path``); a module already
    there is MLX's to read. ``prefetch`` starts a build (in a process of its own where
    ``library`` is set); ``prepare`` waits for it."""

    def __init__(self, folder: Path, nvrtc: Nvrtc, arch: str, includes: list[Path], threads: int = 0,
                 library: str = "") -> None:
        self.folder = folder
        self.nvrtc = nvrtc
        self.library = library  # set: prefetched builds run in processes of their own (``build_apart``)
        # MLX's options (jit_module.cpp); sm_90a on Hopper, as MLX asks for
        self.options = ["--device-as-default-execution-space", f"--gpu-architecture={arch}",
                        *[f"--include-path={p}" for p in includes]]
        self.headers = {UTILS: UTILS_STAND_IN}
        if not any((p / CONFIG).is_file() for p in includes):
            self.headers[CONFIG] = CONFIG_STAND_IN
        self.built = 0  # modules compiled by NVRTC in this process
        self.found = 0  # modules already in the folder
        self.failed = 0  # units that did not build here (MLX builds them)
        self.threads = threads or min(8, os.cpu_count() or 1)
        self.deferring = False  # inside ``deferred()``: launches only prefetch their units
        self.verified = False  # MLX's printed unit compared with ``mlx_source``'s (``verify``)
        self.mismatch: str | None = None  # set when MLX's wrapper differs from ``mlx_source``'s
        self._lock = threading.Lock()  # the counters, from the build threads
        self._pending: dict[str, Future[bool]] = {}
        self._executor: ThreadPoolExecutor | None = None

    @contextlib.contextmanager
    def deferred(self) -> Iterator[None]:
        """Launches inside only start their units' builds (``CachedKernel`` returns zeros); not nestable."""
        assert not self.deferring, "deferred() does not nest"
        self.deferring = True
        try:
            yield
        finally:
            self.deferring = False

    def prefetch(self, func: str, unit: str) -> None:
        """Start building ``unit``, unless its module is on disk or under way."""
        module = mlx_source.module_name(func, unit)
        if module in self._pending or mlx_source.module_path(self.folder, module).is_file():
            return
        if self._executor is None:
            self._executor = ThreadPoolExecutor(self.threads, thread_name_prefix="runtime-nvrtc")
        self._pending[module] = self._executor.submit(self._build, func, unit, module, bool(self.library))

    def prepare(self, func: str, unit: str) -> bool:
        """Make sure MLX finds ``unit``'s module on disk; False where it will build it itself."""
        module = mlx_source.module_name(func, unit)
        future = self._pending.pop(module, None)
        if future is not None:
            return future.result()
        if mlx_source.module_path(self.folder, module).is_file():
            with self._lock:
                self.found += 1
            return True
        return self._build(func, unit, module)

    def _build(self, func: str, unit: str, module: str, apart: bool = False) -> bool:
        """Compile ``unit`` as MLX would (``apart``: in a process of its own) and write the module
        (the kernel names first, then the code, renamed into place: MLX never reads a module
        without its names)."""
        qualified = mlx_source.NAMESPACE + func
        args = (unit, self.options, self.headers, [qualified], module + ".cu")
        cubin, log, lowered = build_apart(self.library, *args) if apart else self.nvrtc.compile(*args)
        if not cubin or qualified not in lowered:
            with self._lock:
                self.failed += 1
            print(f"runtime worker: {func} did not build ahead, MLX builds it: {log[:300]}", file=sys.stderr,
                  flush=True)
            return False
        path = mlx_source.module_path(self.folder, module)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            # each file whole or absent (another worker on this machine may read or write it)
            _write_whole(path.with_suffix(".txt"), f"{qualified}\t{lowered[qualified]}\n".encode())
            _write_whole(path, cubin)
        except OSError:
            return False  # a folder that cannot be written costs MLX a build, nothing else
        with self._lock:
            self.built += 1
        return True


def _write_whole(path: Path, data: bytes) -> None:
    partial = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.part")
    partial.write_bytes(data)
    partial.replace(path)


class CachedKernel:
    """``mx.fast.cuda_kernel``'s callable whose variants' modules the store writes ahead of
    their first launch (one per template, dtypes and ranks of the inputs)."""

    def __init__(self, name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str,
                 store: KernelStore) -> None:
        self.name = name
        self.input_names = list(input_names)
        self.output_names = list(output_names)
        self.source = source
        self.header = header
        self.store = store
        self.mlx = mx.fast.cuda_kernel(name=name, input_names=self.input_names, output_names=self.output_names,
                                       source=source, header=header)
        self._ready: set[tuple] = set()

    def unit(self, key: tuple) -> tuple[str, str]:
        """(the kernel's name, MLX's unit) for a variant key."""
        input_dtypes, input_ndims, output_dtypes, template = key
        func = mlx_source.kernel_name(self.name, template)
        return func, mlx_source.mlx_unit(func, self.header, self.source, self.input_names, input_dtypes, input_ndims,
                                         self.output_names, output_dtypes, template)

    def __call__(self, *, inputs: Sequence[mx.array], template: Sequence[tuple[str, object]],
                 grid: tuple[int, int, int], threadgroup: tuple[int, int, int],
                 output_shapes: Sequence[Sequence[int]], output_dtypes: Sequence[mx.Dtype]) -> list[mx.array]:
        launch = dict(inputs=inputs, template=template, grid=grid, threadgroup=threadgroup,
                      output_shapes=output_shapes, output_dtypes=output_dtypes)
        if self.store.deferring or self.store.mismatch is None:  # else MLX builds every kernel itself
            key = (tuple(a.dtype for a in inputs), tuple(a.ndim for a in inputs), tuple(output_dtypes),
                   tuple(template))
            if key not in self._ready and self.store.mismatch is None:
                func, unit = self.unit(key)
                if verify(self.store, self.mlx, launch, func, unit):
                    if self.store.deferring:
                        self.store.prefetch(func, unit)
                    else:
                        self.store.prepare(func, unit)
                        self._ready.add(key)
            if self.store.deferring:
                return [mx.zeros(tuple(s), dtype=dt) for s, dt in zip(output_shapes, output_dtypes)]
        return self.mlx(**launch)


def verify(store: KernelStore, kernel, launch: dict, func: str, unit: str) -> bool:
    """Once per store: whether MLX's own unit for this launch (what it prints with
    ``verbose=True``, nothing launched) is ``mlx_source``'s; if not, ``store.mismatch`` says why."""
    if store.verified:
        return store.mismatch is None
    store.verified = True
    try:
        printed = mlx_source.printed_unit(_stdout_of(lambda: kernel(**launch, verbose=True)))
    except OSError as exc:  # no file descriptor 1 to borrow: nothing to compare with
        store.mismatch = f"MLX's unit could not be read ({exc})"
        return False
    if printed != (func, unit):
        store.mismatch = (f"MLX {mx.__version__} wraps custom kernels differently from mlx_source "
                          f"({'nothing printed' if printed is None else 'the name or unit differs'})")
    return store.mismatch is None


def _stdout_of(call) -> str:
    """What ``call`` writes to file descriptor 1 (MLX prints from C++)."""
    sys.stdout.flush()
    with tempfile.TemporaryFile() as sink:
        saved = os.dup(1)
        try:
            os.dup2(sink.fileno(), 1)
            call()
        finally:
            os.dup2(saved, 1)
            os.close(saved)
        sink.seek(0)
        return sink.read().decode(errors="replace")


def mlx_cache_folder(env: dict[str, str] | os._Environ) -> Path:
    """MLX's kernel cache folder (``ptx_cache_dir``): MLX_PTX_CACHE_DIR, set by the worker."""
    if env.get("MLX_PTX_CACHE_DIR"):
        return Path(env["MLX_PTX_CACHE_DIR"])
    return Path(tempfile.gettempdir()) / "mlx" / mx.__version__ / "ptx"


@functools.cache
def default_store() -> KernelStore | None:
    """The worker's store: NVRTC as loaded in this process, this GPU's architecture as MLX
    names it, MLX's cache folder; None off a CUDA GPU or where NVRTC cannot be loaded."""
    if not mx.cuda.is_available():
        return None
    library = find_nvrtc()
    if library is None:
        return None
    try:
        nvrtc = Nvrtc(library)
    except OSError:
        return None
    info = mx.device_info()
    major, minor = int(info.get("compute_capability_major", 8)), int(info.get("compute_capability_minor", 0))
    arch = f"sm_{major}{minor}{'a' if major >= 9 else ''}"
    return KernelStore(mlx_cache_folder(os.environ), nvrtc, arch, include_folders(os.environ),
                       library=library_path(library))


def cuda_kernel(name: str, input_names: Sequence[str], output_names: Sequence[str], source: str, header: str = ""):
    """A custom kernel's callable (``mx.fast.cuda_kernel``'s call signature): modules written
    ahead where ``PRECOMPILE`` is on and NVRTC loads, else MLX's own kernel as it is."""
    store = default_store() if PRECOMPILE else None
    if store is None:
        return mx.fast.cuda_kernel(name=name, input_names=list(input_names), output_names=list(output_names),
                                   source=source, header=header)
    return CachedKernel(name, input_names, output_names, source, header, store)


@contextlib.contextmanager
def prefetching() -> Iterator[bool]:
    """A pass whose launches of our kernels only start their NVRTC builds in processes (and
    return zeros), where the store is in use; yields whether it is (if not, the caller should
    skip the pass: MLX's own builds cannot be started ahead)."""
    store = default_store() if PRECOMPILE else None
    if store is None or store.mismatch is not None:
        yield False
        return
    with store.deferred():
        yield True


def summary() -> str | None:
    """The start-up line's account of the store (None where it is not in use)."""
    store = default_store() if PRECOMPILE else None
    if store is None:
        return None
    if store.mismatch is not None:
        return f"our CUDA kernels: MLX builds them ({store.mismatch})"
    failed = f", {store.failed} left to MLX" if store.failed else ""
    return (f"our CUDA kernels: {store.built} built by NVRTC (up to {store.threads} at once), {store.found} found in "
            f"MLX's kernel cache{failed} ({store.folder})")
