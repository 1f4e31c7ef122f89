"""The CUDA paged decode kernels built by NVRTC, as MLX builds them, on a machine without a GPU
(``scripts/nvrtc_check.py``, with a stub for MLX's device headers): every loop builds, spills
no registers, and its block launches at the warps the launch shapes give it.

NVRTC and the CUDA runtime's headers come from pip (the ``test`` extra on Linux x86-64).
``test_paged_kernel_sim.py`` checks the same sources' arithmetic; this checks what only a
CUDA compiler can: the intrinsics and inline PTX, and the register count a launch needs.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from runtime.worker.paths.cuda.kernel_launch import loop_warps, warps_for
from runtime.worker.paths.paged_attention import PagedAttention

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("nvrtc_check", ROOT / "scripts" / "nvrtc_check.py")
nvrtc_check = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(nvrtc_check)

CUDA = nvrtc_check.cuda_folder()
pytestmark = pytest.mark.skipif(CUDA is None, reason="NVRTC from pip (nvidia-cuda-nvrtc, nvidia-cuda-runtime) "
                                                     "is not installed")


@pytest.fixture(scope="module")
def nvrtc():
    return nvrtc_check.Nvrtc(next((CUDA / "lib").glob("libnvrtc.so.*")))


# (loop, query heads per KV head, head dim): Llama-8B's 4 x 128, Llama-1B's 4 x 64, Qwen's 7 x
# 128, a wide group 8 x 128, and 2 x 96.
CASES = [("pipelined", 4, 128), ("pipelined", 8, 128), ("classic", 4, 64), ("pipelined", 2, 96),
         ("mma", 4, 128), ("mma", 4, 64), ("mma", 7, 128), ("mma_ahead", 4, 128), ("mma_ahead", 2, 96)]


@pytest.mark.parametrize(("loop", "n_rep", "head_dim"), CASES)
def test_the_kernel_builds_without_spills_and_launches(nvrtc, loop, n_rep, head_dim):
    assert PagedAttention(False, loop=loop).loop == loop
    warps = loop_warps(loop, warps_for(n_rep, head_dim), head_dim)  # the most a launch of few blocks takes
    source = nvrtc_check.kernel_source("paged", True, True, loop, head_dim, n_rep, 8, warps, nvrtc_check.STUB_HEADER)
    _builds_without_spills_and_launches(nvrtc, source, warps)


def _builds_without_spills_and_launches(nvrtc, source: str, warps: int) -> None:
    built, log, cubin = nvrtc.compile(source, nvrtc_check.build_options(CUDA, []))
    assert built, log[:3000]
    assert cubin
    regs, spilled = nvrtc_check.registers(log)
    assert regs > 0, log[:3000]
    assert spilled == 0, f"{spilled} bytes of spill stores at {regs} registers"
    assert nvrtc_check.launches(regs, warps), f"{warps} warps of {regs} registers a lane cannot launch"


@pytest.mark.parametrize(("loop", "split", "n_rep", "head_dim", "rope"), [
    ("mma", False, 4, 64, (1, 64, False)), ("mma", True, 4, 128, (2, 128, False)),
    ("mma_ahead", True, 4, 128, (1, 128, False)), ("pipelined", False, 7, 128, (1, 64, True))])
def test_the_rotating_kernel_builds_without_spills_and_launches(nvrtc, loop, split, n_rep, head_dim, rope):
    """The appending kernel with its RoPE stage (``kernel_rope``): the same build checks."""
    warps = loop_warps(loop, warps_for(n_rep, head_dim), head_dim, split=split)
    source = nvrtc_check.kernel_source("paged", True, split, loop, head_dim, n_rep, 8, warps, nvrtc_check.STUB_HEADER,
                                       rope=rope)
    assert "rope_consts" in source and "cosf" in source
    _builds_without_spills_and_launches(nvrtc, source, warps)


@pytest.mark.parametrize("cap", [168, 128])
def test_a_register_cap_holds_the_split_kernel_to_it(nvrtc, cap):
    """``register_cap`` (``PagedAttention(split_registers=...)``): the build keeps to the cap,
    where the uncapped one takes more (mma_ahead at 4 x 128: 255)."""
    options = nvrtc_check.build_options(CUDA, [])
    regs = {}
    for registers in (0, cap):
        source = nvrtc_check.kernel_source("paged", True, True, "mma_ahead", 128, 4, 8, 8, nvrtc_check.STUB_HEADER,
                                           registers)
        built, log, _ = nvrtc.compile(source, options)
        assert built, log[:3000]
        regs[registers] = nvrtc_check.registers(log)[0]
    assert regs[0] > cap >= regs[cap] > 0


def test_a_kernel_error_fails_the_build(nvrtc):
    source = nvrtc_check.kernel_source("paged", True, True, "mma", 128, 4, 8, 8, nvrtc_check.STUB_HEADER)
    built, log, _ = nvrtc.compile(source.replace("__byte_perm(", "__byte_permute("), nvrtc_check.build_options(CUDA, []))
    assert not built and "__byte_permute" in log


def test_the_launch_arithmetic():
    assert nvrtc_check.launches(128, 16) and not nvrtc_check.launches(129, 16)  # 136 x 32 x 16 > 65,536
    assert nvrtc_check.launches(255, 8) and not nvrtc_check.launches(0, 1)
