"""NVRTC through ctypes (the library MLX itself loaded, else pip's), and the folders MLX's own
builds include, so a unit we compile is compiled as MLX would compile it."""

from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import mlx.core as mx


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
