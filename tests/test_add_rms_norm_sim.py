"""The fused residual add + RMSNorm kernel's source (``paths/cuda/add_rms_norm``) run on the CPU.

``cuda_sim``'s stubs (one thread per CUDA lane, warp shuffles through barriers, bf16 rounding to
nearest even) with cooperative groups' block, tile and warp reduction written on top. This
checks the kernel's indexing and arithmetic at MLX's launch shapes against a float64 reference
(the sum exactly, the norm within bf16 rounding); its bits against MLX's own kernels are the
GPU's to check (``test_fused_residual``, and the worker at start-up).
"""

from __future__ import annotations

import numpy as np
import pytest
from cuda_sim import RUNNER, STUBS, bf16_bits, binary, from_bf16_bits, unavailable

from runtime.worker.paths.cuda import add_rms_norm

UNAVAILABLE = unavailable()
pytestmark = pytest.mark.skipif(UNAVAILABLE is not None, reason=f"cannot simulate the CUDA kernels: {UNAVAILABLE}")

# Cooperative groups as the kernel uses them: the block, its 32-lane tiles and their sum.
_GROUPS = r"""
int sim_threads;
inline bf16 operator+(bf16 a, bf16 b) { return bf16(float(a) + float(b)); }
inline bf16 operator*(bf16 a, bf16 b) { return bf16(float(a) * float(b)); }
inline float rsqrt(float x) { return 1.0f / std::sqrt(x); }
namespace cg {
struct thread_block { void sync() const { __syncthreads(); } };
inline thread_block this_thread_block() { return {}; }
struct tile32 {
    unsigned thread_rank() const { return threadIdx.x % 32; }
    unsigned meta_group_rank() const { return threadIdx.x / 32; }
    unsigned meta_group_size() const { return sim_threads / 32; }
};
template <int N>
inline tile32 tiled_partition(thread_block) { return {}; }
template <typename T>
struct plus {};
inline float reduce(tile32, float v, plus<float>) {
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffff, v, off);
    return v;
}
}  // namespace cg
"""


def _program(block: int, chunks: int, width: int, offset: int = 0) -> str:
    """The kernel's program; ``offset`` > 0 shifts every row array by that many elements (so no
    row start is 16-byte aligned and the kernel takes its element-by-element path)."""
    kernel = (f"template <typename T, int BLOCK, int CHUNKS, int N>\nvoid add_rms_norm(const T* x, const T* r, const T* w,"
              f" const float* eps, T* h, T* out) {{\n{add_rms_norm.SOURCE}\n}}\n")
    main = f"""
int main() {{
    int rows;
    if (fread(&rows, sizeof rows, 1, stdin) != 1) return 1;
    const auto x = read_array<bf16>();
    const auto r = read_array<bf16>();
    const auto w = read_array<bf16>();
    const auto eps = read_array<float>();
    const int off = {offset};
    std::vector<bf16> xs(x.size() + off), rs(r.size() + off), ws(w.size() + off), hs(x.size() + off), outs(x.size() + off);
    std::copy(x.begin(), x.end(), xs.begin() + off);
    std::copy(r.begin(), r.end(), rs.begin() + off);
    std::copy(w.begin(), w.end(), ws.begin() + off);
    sim_threads = {block};
    launch(rows, {block}, [&] {{ add_rms_norm<bf16, {block}, {chunks}, {width}>(xs.data() + off, rs.data() + off,
        ws.data() + off, eps.data(), hs.data() + off, outs.data() + off); }});
    write_array(std::vector<bf16>(hs.begin() + off, hs.end()));
    write_array(std::vector<bf16>(outs.begin() + off, outs.end()));
    return 0;
}}
"""
    return STUBS + _GROUPS + kernel + RUNNER + main


def _run(rows: int, width: int, seed: int = 0, offset: int = 0) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    import subprocess

    block, chunks = add_rms_norm.launch_geometry(width, 2)
    rng = np.random.default_rng(seed)
    x = from_bf16_bits(bf16_bits(3 * rng.standard_normal((rows, width))))
    r = from_bf16_bits(bf16_bits(rng.standard_normal((rows, width))))
    w = from_bf16_bits(bf16_bits(1 + 0.1 * rng.standard_normal(width)))
    eps = np.array([1e-5], np.float32)
    stdin = [np.array([rows], np.int32).tobytes()]
    for data in (bf16_bits(x), bf16_bits(r), bf16_bits(w), eps):
        stdin += [np.array([data.size], np.int64).tobytes(), np.ascontiguousarray(data).tobytes()]
    ran = subprocess.run([str(binary(_program(block, chunks, width, offset)))], input=b"".join(stdin), capture_output=True,
                         check=True, timeout=120)
    result = np.frombuffer(ran.stdout, np.float32)
    return x, r, w, result[: x.size].reshape(rows, width), result[x.size:].reshape(rows, width)


@pytest.mark.parametrize("width", [
    96,  # fewer elements than the block has vectors: every thread past them reads zeros
    512,  # 64 threads, one vector each
    2048,  # 128 x 2 (Llama-3.2-1B)
    2560,  # 64 x 5
    5000,  # 128 x 5, the last vectors partly past the row
])
def test_the_kernel_adds_and_normalizes_each_row(width):
    x, r, w, h, out = _run(3, width)
    expected_h = from_bf16_bits(bf16_bits(x + r))
    assert (h == expected_h).all()  # one rounding of the float sum, as CUDA's bf16 add
    sums = expected_h.astype(np.float64)
    reference = sums / np.sqrt((sums**2).mean(axis=1, keepdims=True) + 1e-5) * w
    assert np.abs(out - reference).max() <= 0.02 * np.abs(reference).max()


@pytest.mark.parametrize("width", [2048, 5000])
def test_unaligned_rows_take_the_element_path_with_the_same_bits(width):
    _, _, _, h, out = _run(3, width)
    _, _, _, h_unaligned, out_unaligned = _run(3, width, offset=1)
    assert (h_unaligned == h).all() and (out_unaligned == out).all()
