"""What MLX's ``mx.fast.cuda_kernel`` makes of a kernel, and where MLX looks for it on disk.

MLX (``mlx/backend/cuda/custom_kernel.cpp``, 0.32) wraps a custom kernel's source into one
translation unit (``build_kernel``), names the kernel ``custom_kernel_NAME`` plus its template
values, and at the first launch in a process asks ``get_jit_module`` for the module
``{kernel name}_{std::hash(unit):x}``. That function first reads ``{module}.ptx`` (and the
kernel names of ``{module}.txt``) from MLX's kernel cache folder and compiles with NVRTC only
when the file is absent; for custom kernels it never writes the file. Writing it ourselves
(``cubin_kernels``) lets every later start skip NVRTC, while each launch stays MLX's own.

This module repeats those rules: ``mlx_unit`` (the wrapper), ``std_hash`` (libstdc++'s
``std::hash<std::string>``), ``module_name`` and ``module_path``. If MLX's wrapper changes, the
module name no longer matches, MLX compiles as before, and ``matches_mlx`` says so at start-up.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from pathlib import Path

import mlx.core as mx

# MLX's dtype_to_cuda_type (parameters, ``using`` lines) and get_type_string (kernel names).
_CUDA_TYPES = {mx.bool_: "bool", mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t",
               mx.uint8: "uint8_t", mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t",
               mx.float16: "__half", mx.bfloat16: "__nv_bfloat16", mx.float32: "float"}
_NAME_TYPES = {mx.float32: "float", mx.float16: "float16_t", mx.bfloat16: "bfloat16_t", mx.bool_: "bool",
               mx.int8: "int8_t", mx.int16: "int16_t", mx.int32: "int32_t", mx.int64: "int64_t", mx.uint8: "uint8_t",
               mx.uint16: "uint16_t", mx.uint32: "uint32_t", mx.uint64: "uint64_t"}
DEFAULT_HEADER = '\n#include "mlx/backend/cuda/device/utils.cuh"\n\n#include <cooperative_groups.h>\n\n'
NAMESPACE = "mlx::core::cu::"
MAX_FILE_NAME = 245  # get_ptx_path: longer module names become folders of this many characters
_MASK = (1 << 64) - 1
_MUL = (0xC6A4A793 << 32) + 0x5BD1E995
_SEED = 0xC70F6907


def kernel_name(name: str, template: Sequence[tuple[str, object]]) -> str:
    """``custom_kernel_NAME`` and each template value (``_4``, ``_t``, ``_bfloat16_t``)."""
    parts = []
    for _, value in template:
        if isinstance(value, bool):
            parts.append("_t" if value else "_f")
        elif isinstance(value, mx.Dtype):
            parts.append("_" + _NAME_TYPES[value])
        else:
            parts.append(f"_{int(value)}")
    return "custom_kernel_" + name + "".join(parts)


def shape_infos(source: str, input_names: Sequence[str]) -> list[tuple[bool, bool, bool]]:
    """Per input, whether the source reads ``NAME_shape``, ``NAME_strides``, ``NAME_ndim``
    (MLX searches for the substring, not the word)."""
    return [(f"{n}_shape" in source, f"{n}_strides" in source, f"{n}_ndim" in source) for n in input_names]


def mlx_unit(func: str, header: str, source: str, input_names: Sequence[str], input_dtypes: Sequence[mx.Dtype],
             input_ndims: Sequence[int], output_names: Sequence[str], output_dtypes: Sequence[mx.Dtype],
             template: Sequence[tuple[str, object]]) -> str:
    """The translation unit MLX's ``build_kernel`` makes, byte for byte."""
    out = [DEFAULT_HEADER, header, "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n",
           "__global__ void ", func, "(\n"]
    for name, dtype, ndim, (shape, strides, ndim_used) in zip(input_names, input_dtypes, input_ndims,
                                                              shape_infos(source, input_names)):
        out.append(f"    const {_CUDA_TYPES[dtype]}* {name},\n")
        if ndim > 0:
            if shape:
                out.append(f"    const __grid_constant__ Shape {name}_shape,\n")
            if strides:
                out.append(f"    const __grid_constant__ Strides {name}_strides,\n")
            if ndim_used:
                out.append(f"    const __grid_constant__ int {name}_ndim,\n")
    for i, (name, dtype) in enumerate(zip(output_names, output_dtypes)):
        out.append(f"    {_CUDA_TYPES[dtype]}* {name}" + (",\n" if i < len(output_names) - 1 else ") {\n"))
    if template:
        for name, value in template:
            if isinstance(value, bool):
                out.append(f"  constexpr bool {name} = {'true' if value else 'false'};\n")
            elif isinstance(value, mx.Dtype):
                out.append(f"  using {name} = {_CUDA_TYPES[value]};\n")
            else:
                out.append(f"  constexpr int {name} = {int(value)};\n")
        out.append("\n")
    out += [source, "\n}\n\n} // namespace mlx::core::cu\n"]
    return "".join(out)


def _shift_mix(v: int) -> int:
    return v ^ (v >> 47)


def std_hash(data: bytes) -> int:
    """libstdc++'s ``std::hash<std::string>`` on a 64-bit platform (``_Hash_bytes``, seed 0xc70f6907)."""
    n = len(data)
    aligned = n & ~7
    h = (_SEED ^ (n * _MUL)) & _MASK
    words = memoryview(data)[:aligned].cast("Q") if aligned else ()
    for word in words:
        h ^= (_shift_mix((word * _MUL) & _MASK) * _MUL) & _MASK
        h = (h * _MUL) & _MASK
    if n & 7:
        h ^= int.from_bytes(data[aligned:], "little")
        h = (h * _MUL) & _MASK
    h = (_shift_mix(h) * _MUL) & _MASK
    return _shift_mix(h)


def module_name(func: str, unit: str) -> str:
    """The name MLX gives the kernel's module (and its cache file)."""
    return f"{func}_{std_hash(unit.encode()):x}"


def module_path(cache: Path, module: str) -> Path:
    """Where MLX reads the module's code (``get_ptx_path``); ``.txt`` beside it names its kernels."""
    if len(module) <= MAX_FILE_NAME:
        return cache / f"{module}.ptx"
    path, offset = cache, 0
    while len(module) - offset > MAX_FILE_NAME:
        path = path / module[offset:offset + MAX_FILE_NAME]
        offset += MAX_FILE_NAME
    return path / f"{module[offset:]}.ptx"


def printed_unit(text: str) -> tuple[str, str] | None:
    """(kernel name, unit) from what MLX prints for a kernel launched with ``verbose=True``."""
    m = re.search(r"Generated source code for `([^`]+)`:\n```\n(.*)\n```\n", text, re.S)
    return (m.group(1), m.group(2)) if m else None
