"""NVRTC through ctypes (the library MLX itself loaded, else pip's), and the folders MLX's own
builds include, so a unit we compile is compiled as MLX would compile it.

NVRTC compiles one program at a time in a process (threads measured no faster), so builds run
side by side in processes (``build``, for a spawned pool): this module imports no MLX.
"""

from __future__ import annotations

import ctypes
import functools
import os
import pickle
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[4]  # the folder holding the ``runtime`` package
_CHILD = ("import pickle, sys\nfrom runtime.worker.paths.cuda.nvrtc import build\n"
          "sys.stdout.buffer.write(pickle.dumps(build(*pickle.loads(sys.stdin.buffer.read()))))\n")


class Nvrtc:
    """The NVRTC calls a build needs. ctypes lets go of the GIL while NVRTC works, so builds on
    several threads run side by side."""

    def __init__(self, library: str) -> None:
        self.lib = ctypes.CDLL(library)
        self.lib.nvrtcGetLoweredName.argtypes = [ctypes.c_void_p, ctypes.c_char_p, ctypes.POINTER(ctypes.c_char_p)]
        major, minor = ctypes.c_int(), ctypes.c_int()
        self.lib.nvrtcVersion(ctypes.byref(major), ctypes.byref(minor))
        self.version = f"{major.value}.{minor.value}"

    def compile(self, source: str, options: list[str], headers: dict[str, str] | None = None,
                names: list[str] | None = None, program: str = "kernel.cu") -> tuple[bytes, str, dict[str, str]]:
        """(the CUBIN, b"" if the build failed; NVRTC's log; each of ``names`` lowered), with
        ``headers`` (include name: text) given to the program in memory."""
        headers = headers or {}
        names = names or []
        prog = ctypes.c_void_p()
        texts = (ctypes.c_char_p * len(headers))(*[t.encode() for t in headers.values()])
        includes = (ctypes.c_char_p * len(headers))(*[n.encode() for n in headers])
        if self.lib.nvrtcCreateProgram(ctypes.byref(prog), source.encode(), program.encode(), len(headers),
                                       texts, includes):
            return b"", "nvrtcCreateProgram failed", {}
        try:
            for name in names:
                self.lib.nvrtcAddNameExpression(prog, name.encode())
            opts = (ctypes.c_char_p * len(options))(*[o.encode() for o in options])
            result = self.lib.nvrtcCompileProgram(prog, len(options), opts)
            size = ctypes.c_size_t()
            self.lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
            log = ctypes.create_string_buffer(size.value + 1)
            self.lib.nvrtcGetProgramLog(prog, log)
            text = log.value.decode(errors="replace")
            if result != 0:
                return b"", text, {}
            lowered = {}
            for name in names:
                out = ctypes.c_char_p()
                if self.lib.nvrtcGetLoweredName(prog, name.encode(), ctypes.byref(out)) == 0 and out.value:
                    lowered[name] = out.value.decode()
            self.lib.nvrtcGetCUBINSize(prog, ctypes.byref(size))
            cubin = ctypes.create_string_buffer(size.value)
            self.lib.nvrtcGetCUBIN(prog, cubin)
            return cubin.raw, text, lowered
        finally:
            self.lib.nvrtcDestroyProgram(ctypes.byref(prog))


@functools.cache
def _loaded(library: str) -> Nvrtc:
    return Nvrtc(library)


def build(library: str, source: str, options: list[str], headers: dict[str, str], names: list[str],
          program: str) -> tuple[bytes, str, dict[str, str]]:
    """``Nvrtc.compile`` with ``library`` loaded once per process (a build process's entry point)."""
    return _loaded(library).compile(source, options, headers, names, program)


def build_apart(library: str, source: str, options: list[str], headers: dict[str, str], names: list[str],
                program: str) -> tuple[bytes, str, dict[str, str]]:
    """``build`` in a fresh Python process (NVRTC compiles one program at a time a process, so
    builds side by side need processes); a process that fails answers with no CUBIN and why."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]))
    job = pickle.dumps((library, source, options, headers, names, program))
    try:
        done = subprocess.run([sys.executable, "-c", _CHILD], input=job, capture_output=True, env=env, timeout=600)
    except (OSError, subprocess.TimeoutExpired) as exc:
        return b"", f"the build process failed: {exc}", {}
    if done.returncode != 0:
        return b"", done.stderr.decode(errors="replace")[-2000:], {}
    return pickle.loads(done.stdout)


def library_path(library: str) -> str:
    """``library`` as a path another process can load: MLX's NVRTC is found by its own run path."""
    if os.sep in library:
        return library
    folder = cuda_folder()
    found = sorted((folder / "lib").glob(f"{library}*")) if folder is not None else []
    return str(found[0]) if found else library


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
    """MLX's include folders (``jit_module.cpp``: its bundled headers, CCCL, the CUDA runtime's
    headers from pip or CUDA_HOME), then pip's CCCL for a machine whose MLX bundles none."""
    import mlx.core as mx

    mlx_include = Path(mx.__file__).parent / "include"
    folders = [mlx_include, mlx_include / "cccl"]
    pip = cuda_folder()
    if pip is not None:
        folders.append(pip / "include")
    for var in ("CUDA_HOME", "CUDA_PATH"):
        if env.get(var):
            folders.append(Path(env[var]) / "include")
            break
    folders.append(Path("/usr/local/cuda/include"))
    if pip is not None:
        folders.append(pip / "include" / "cccl")
    seen: list[Path] = []
    for folder in folders:
        if folder.is_dir() and folder not in seen:
            seen.append(folder)
    return seen
