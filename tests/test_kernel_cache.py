"""The worker's lasting CUDA kernel cache directory (no GPU needed: it only sets a variable)."""

from __future__ import annotations

from pathlib import Path

from runtime.worker.paths.cuda.kernel_cache import CACHE_VAR, keep_kernel_cache


def test_cuda_worker_keeps_kernels_under_the_user_cache_per_version_and_gpu(tmp_path: Path):
    env = {"HOME": str(tmp_path)}
    got = keep_kernel_cache(env, True, "0.32.4", "NVIDIA H200 (SXM)")
    expected = tmp_path / ".cache" / "runtime" / "mlx-kernels" / "0.32.4" / "NVIDIA-H200-SXM"
    assert got == str(expected) and env[CACHE_VAR] == str(expected) and expected.is_dir()
    xdg = {"HOME": str(tmp_path), "XDG_CACHE_HOME": str(tmp_path / "xdg")}
    assert keep_kernel_cache(xdg, True, "0.32.4", "") == str(tmp_path / "xdg" / "runtime" / "mlx-kernels" / "0.32.4" / "gpu")


def test_a_chosen_directory_and_the_cpu_are_left_alone(tmp_path: Path):
    chosen = {"HOME": str(tmp_path), CACHE_VAR: "/elsewhere"}
    assert keep_kernel_cache(chosen, True, "0.32.4", "H200") is None and chosen[CACHE_VAR] == "/elsewhere"
    cpu = {"HOME": str(tmp_path)}
    assert keep_kernel_cache(cpu, False, "0.32.4", "H200") is None and CACHE_VAR not in cpu


def test_an_unwritable_home_falls_back_to_mlx_default(tmp_path: Path):
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    env = {"HOME": str(blocker)}
    assert keep_kernel_cache(env, True, "0.32.4", "H200") is None and CACHE_VAR not in env
