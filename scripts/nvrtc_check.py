"""Build the paged decode kernels with NVRTC on a machine without a GPU, as MLX would build them,
and print each build's register count and spills (ptxas's own report).

A kernel that does not build, or that spills registers, is then found here rather than in a
GPU window. NVRTC and the CUDA headers come from pip (no GPU or driver is needed to compile):

    python3 -m venv /tmp/nvrtc && /tmp/nvrtc/bin/pip install "nvidia-cuda-nvrtc==13.*" "nvidia-cuda-runtime==13.*"
    # MLX's device headers: its source at the wheel's version, and the CUDA wheel's include dir
    python3 scripts/nvrtc_check.py --site /tmp/nvrtc/lib/python3.11/site-packages \
        --include /tmp/mlxdev --include /tmp/mlxcuda/mlx/include --include /tmp/mlxcuda/mlx/include/cccl
    # or, with a stub for MLX's headers (what tests/test_paged_kernel_nvrtc.py builds):
    python3 scripts/nvrtc_check.py --site /tmp/nvrtc/lib/python3.11/site-packages --stub

The source wrapping repeats ``mlx/backend/cuda/custom_kernel.cpp`` (MLX 0.32): its default
header, the ``mlx::core::cu`` namespace, one pointer per input and output, ``Shape`` parameters
for the ``NAME_shape`` names the source uses, and the template arguments as constants.
"""

from __future__ import annotations

import argparse
import collections
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from runtime.worker.paths.cuda import nvrtc  # noqa: E402
from runtime.worker.paths.cuda import paged_kernels as pk  # noqa: E402
from runtime.worker.paths.cuda.kernel_launch import (  # noqa: E402
    REGISTERS,
    lanes_per_position,
    loop_warps,
    warps_for,
)

_INT_INPUTS = {"table", "rows", "lengths", "tail_len", "positions"}
_FLOAT_INPUTS = {"scale", "rope_consts", "rope_freqs"}
SASS_KINDS = ("LDG", "LDS", "STS", "LDSM", "HMMA", "SHFL", "PRMT", "FFMA", "FMUL", "FADD", "MUFU", "F2F", "BRA")
_DEFAULT_HEADER = '#include "mlx/backend/cuda/device/utils.cuh"\n#include <cooperative_groups.h>\n'
# Without MLX's device headers (``--stub``, the CI test): the two things of theirs the kernels use.
STUB_HEADER = """#include <cuda_bf16.h>
#include <cuda_fp16.h>
#define INFINITY __int_as_float(0x7f800000)
namespace cooperative_groups {}  // the wrapper names it; the kernels use none of it
namespace mlx::core::cu {
struct Shape {
    int data[8];
    __device__ int operator[](int i) const { return data[i]; }
};
}
"""


def kernel_source(name: str, appending: bool, split: bool, loop: str, d: int, n_rep: int, n_kv: int,
                  warps: int, header: str = _DEFAULT_HEADER, registers: int = 0,
                  rope: tuple[int, int, bool] | None = None) -> str:
    """The full translation unit MLX's ``cuda_kernel`` makes of the decode kernel's source;
    ``rope`` (mode, dims, traditional): the appending kernel that rotates."""
    body = pk.body(appending, loop, rope is not None) + (pk.WRITE_PARTIAL if split else pk.WRITE_OUT)
    inputs = pk.ROPE_INPUTS if rope else pk.APPEND_INPUTS if appending else pk.INPUTS
    outputs = (["part_acc", "part_m", "part_l"] if split else ["out"]) + (pk.APPEND_OUTPUTS if appending else [])
    params = []
    for arg in inputs:
        kind = "int" if arg in _INT_INPUTS else "float" if arg in _FLOAT_INPUTS else "__nv_bfloat16"
        params.append(f"    const {kind}* {arg}")
        if re.search(rf"\b{arg}_shape\b", body):
            params.append(f"    const __grid_constant__ Shape {arg}_shape")
    params += [f"    {'float' if out.startswith('part') else '__nv_bfloat16'}* {out}" for out in outputs]
    constants = (f"  using T = __nv_bfloat16;\n  constexpr int D = {d};\n  constexpr int NREP = {n_rep};\n"
                 f"  constexpr int HKV = {n_kv};\n  constexpr int NWARPS = {warps};\n  constexpr int UNROLL = 1;\n"
                 f"  constexpr int GL = {lanes_per_position(d)};\n")
    if rope is not None:
        constants += (f"  constexpr int ROPE = {rope[0]};\n  constexpr int ROPE_DIMS = {rope[1]};\n"
                      f"  constexpr bool ROPE_TRAD = {str(rope[2]).lower()};\n")
    return (header + pk.register_cap(registers) + pk.HEADER + "namespace mlx::core::cu {\n\nnamespace cg = cooperative_groups;\n\n"
            f"__global__ void {name}(\n" + ",\n".join(params) + ") {\n" + constants + "\n" + body
            + "\n}\n\n} // namespace mlx::core::cu\n")


class Nvrtc:
    """The worker's NVRTC calls (``paths/cuda/nvrtc.Nvrtc``), answering (built, the log, the CUBIN)."""

    def __init__(self, library: Path) -> None:
        self.nvrtc = nvrtc.Nvrtc(str(library))

    def compile(self, source: str, options: list[str]) -> tuple[bool, str, bytes]:
        cubin, log, _ = self.nvrtc.compile(source, options)
        return bool(cubin), log, cubin


def cuda_folder(site: Path | None = None) -> Path | None:
    """The pip-installed CUDA 13 folder (``nvidia/cu13``: NVRTC, the runtime's headers), or None."""
    roots = [site] if site is not None else [Path(p) for p in sys.path if p]
    for root in roots:
        folder = root / "nvidia" / "cu13"
        if any((folder / "lib").glob("libnvrtc.so.*")) and (folder / "include" / "cuda_bf16.h").exists():
            return folder
    return None


def build_options(cuda: Path, includes: list[Path], arch: str = "sm_90a") -> list[str]:
    """MLX's NVRTC options (``jit_module.cpp``), and ptxas's register report."""
    paths = [f"--include-path={path}" for path in [*includes, cuda / "include"]]
    return ["--device-as-default-execution-space", f"--gpu-architecture={arch}", "--ptxas-options=-v", *paths]


def registers(log: str) -> tuple[int, int]:
    """(registers a lane, spill store bytes) from ptxas's report in a build log (0, 0 if absent)."""
    used = re.search(r"Used (\d+) registers", log)
    spills = re.search(r"(\d+) bytes spill stores", log)
    return (int(used.group(1)) if used else 0), (int(spills.group(1)) if spills else 0)


def launches(regs: int, warps: int) -> bool:
    """Whether a block of ``warps`` warps of ``regs`` registers a lane fits the register file."""
    return 0 < regs and -(-regs // 8) * 8 * 32 * warps <= REGISTERS  # allocated 8 at a time a lane


def opcode_counts(nvdisasm: Path, cubin: bytes) -> dict[str, int]:
    """Static SASS instructions of a CUBIN by opcode (its first word, less modifiers)."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run([str(nvdisasm), f.name], capture_output=True, text=True, check=True).stdout
    counts: dict[str, int] = collections.Counter()
    for line in text.splitlines():
        m = re.match(r"\s*/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_]*)", line)
        if m:
            counts[m.group(1)] += 1
    return dict(counts)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--site", type=Path, required=True, help="site-packages holding nvidia/cu13 (NVRTC, headers)")
    p.add_argument("--include", type=Path, action="append", default=[], help="more include folders (MLX's)")
    p.add_argument("--arch", default="sm_90a", help="the GPU architecture (MLX builds sm_90a on an H100/H200)")
    p.add_argument("--loops", default="pipelined,mma,mma_ahead")
    p.add_argument("--shapes", default="4x128,8x64,2x96,1x128", help="query heads per KV head x head dim, ...")
    p.add_argument("--warps", default="4,16")
    p.add_argument("--sass", action="store_true", help="also count each build's SASS instructions by kind (nvdisasm)")
    p.add_argument("--launches", action="store_true",
                   help="per loop and shape, whether the most warps the launch shapes pick (few blocks) can launch")
    p.add_argument("--stub", action="store_true", help="a stub for MLX's device headers (no --include needed)")
    p.add_argument("--registers", type=int, default=0, help="a register cap for every build (0: none)")
    args = p.parse_args()
    cuda = cuda_folder(args.site)
    if cuda is None:
        sys.exit(f"no nvidia/cu13 with NVRTC and cuda_bf16.h under {args.site}")
    nvrtc = Nvrtc(next((cuda / "lib").glob("libnvrtc.so.*")))
    options = build_options(cuda, args.include, args.arch)
    header = STUB_HEADER if args.stub else _DEFAULT_HEADER
    failures = 0
    if args.launches:
        for loop in args.loops.split(","):
            for shape in args.shapes.split(","):
                n_rep, d = (int(x) for x in shape.split("x"))
                warps = loop_warps(loop, warps_for(n_rep, d), d)
                ok, log, _ = nvrtc.compile(kernel_source("paged", True, True, loop, d, n_rep, 8, warps, header),
                                           options)
                regs = registers(log)[0] if ok else 0
                fits = launches(regs, warps)
                failures += not fits
                print(f"{loop:10} nrep {n_rep} d {d:3}: picks {warps:2} warps, {regs or '?'} registers: "
                      f"{'launches' if fits else 'CANNOT LAUNCH'}")
        return 1 if failures else 0
    for loop in args.loops.split(","):
        for shape in args.shapes.split(","):
            n_rep, d = (int(x) for x in shape.split("x"))
            for warps in (int(w) for w in args.warps.split(",")):
                for appending in (False, True):
                    for split in (False, True):
                        name = f"paged_{loop}_{'append' if appending else 'read'}_{'split' if split else 'single'}"
                        ok, log, cubin = nvrtc.compile(
                            kernel_source(name, appending, split, loop, d, n_rep, 8, warps, header, args.registers),
                            options)
                        label = f"{name:34} nrep {n_rep} d {d:3} warps {warps:2}"
                        if not ok:
                            failures += 1
                            print(f"{label}: FAILED\n{log[:3000]}")
                        else:
                            regs, spilled = registers(log)
                            fits = max((w for w in (1, 2, 4, 8, 16) if launches(regs, w)), default=0) if regs else "?"
                            print(f"{label}: {regs or '?'} registers (a block of at most {fits} warps launches), "
                                  f"{spilled} bytes of spill stores")
                            if args.sass:
                                counts = opcode_counts(cuda / "bin" / "nvdisasm", cubin)
                                kinds = {k: sum(v for op, v in counts.items() if op.startswith(k)) for k in SASS_KINDS}
                                print(f"    {sum(counts.values())} instructions: "
                                      + ", ".join(f"{k} {n}" for k, n in kinds.items()))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
