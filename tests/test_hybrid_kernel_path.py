"""Every hybrid family that takes the CUDA kernel path (the GPU's default), token-exact against
mlx-lm: the decode tail, the compiled step with the recurrent states as its inputs and outputs,
and a steady batch's states kept out of the aux pool between steps (``AuxPool.keep``). On the
CPU the kernels are replaced by their reference computations; on a CUDA GPU the real kernels
run (tokens then as mlx-lm's up to a shown near-tie)."""

from __future__ import annotations

import random

import pytest
from harness import InProcessService
from model_factory import ARCHS, REFUSED
from near_tie import assert_requests_like_mlx
from test_paged_attention import _reference_kernels

from runtime.worker.paths.paged_attention import PagedAttention

HYBRID_KERNEL_PATH = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "nemotron_h", "lfm2", "lfm2_moe", "lfm2-vl",
                      "falcon_h1", "jamba", "granitemoehybrid", "bailing_moe_linear", "olmo_hybrid")


def _kernels(monkeypatch) -> None:
    if not PagedAttention.kernel_available():
        _reference_kernels(monkeypatch)


def _service(folder) -> InProcessService:
    return InProcessService(folder, max_running=8, row_cache=False, aux_slots=64, track_chunk=8,
                            max_step_tokens=96, prefill_chunk=16)


def test_which_hybrid_families_take_the_compiled_kernel_path(model_dir, monkeypatch):
    _reference_kernels(monkeypatch)  # (routing, not the kernels: a GPU's kernels skip some tiny head widths)
    taken = set()
    for arch in (a for a in ARCHS if a not in REFUSED):
        engine = _service(model_dir(arch)).engine
        if engine.aux_pool is not None and engine.compiled_paged is not None:
            assert engine.paths.tail is not None and not engine.fuse_prefill
            taken.add(arch)
    assert taken == set(HYBRID_KERNEL_PATH), " ".join(sorted(taken ^ set(HYBRID_KERNEL_PATH)))


@pytest.mark.parametrize("arch", HYBRID_KERNEL_PATH)
def test_hybrid_families_on_the_kernel_path_decode_as_mlx_lm(arch, model_dir, monkeypatch):
    """Requests arriving while others decode and finishing at different steps (batches change,
    states go back to the pool), prefix hits at tracked boundaries among them."""
    _kernels(monkeypatch)
    folder = model_dir(arch)
    svc = _service(folder)
    rng = random.Random(5)
    shared = [rng.randrange(3, 250) for _ in range(24)]
    reqs = [svc.request(f"r{i}", shared[: 9 + 5 * i] + [rng.randrange(3, 250) for _ in range(3 + 4 * i)], 5 + 3 * (i % 3))
            for i in range(6)]
    svc.run({0: reqs[:2], 3: reqs[2:4], 9: reqs[4:]})
    assert sum(r.prefix_len > 0 for r in reqs) >= 2
    assert_requests_like_mlx(folder, reqs)  # strict on the CPU
