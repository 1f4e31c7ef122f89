"""The CUDA paged decode kernels run on the CPU, for machines without a GPU.

``paged_kernels``' sources are compiled as C++20 with g++ behind a few stubs (``__device__``,
``uint4``, a bf16 type rounding to nearest even) and launched one block after another, each
with one ``std::thread`` per CUDA lane: ``__shfl_xor_sync`` exchanges values between the 32
lanes of a warp through a barrier, ``__syncthreads`` waits on a block-wide one, and
``__shared__`` arrays are statics shared by the block's lanes. A split launch is followed by
the COMBINE kernel, as on the GPU. The result is compared with a float64 numpy reference.

The tensor-core loop's ``mma.sync``, ``__shfl_sync``, ``__any_sync`` and ``__byte_perm`` are
emulated with the PTX ISA's fragment layouts and CUDA's byte selection. This checks the
kernels' arithmetic and indexing (slot table, tail, splits, warp and group merges, the appended
tail's copy), not their speed or anything CUDA-specific about memory:
coalescing, shared-memory banks, the memory model. Buffers come from ``std::vector`` (16-byte
aligned), so the 16-byte load paths run wherever the kernels' alignment checks allow them.
"""

from __future__ import annotations

import functools
import hashlib
import shutil
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path

import numpy as np

from runtime.worker.paths.cuda import paged_kernels as pk
from runtime.worker.paths.cuda.kernel_launch import lanes_per_position

CXX = ["g++", "-std=c++20", "-O1", "-fno-strict-aliasing", "-pthread"]

# C++ stand-ins for CUDA's built-ins (threads of a block run as host threads), for any simulated kernel.
STUBS = r"""
#include <algorithm>
#include <barrier>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <thread>
#include <vector>
using std::min;
#define __device__
#define __global__
#define __shared__ static
#define __align__(n) __attribute__((aligned(n)))
struct uint4 { unsigned x, y, z, w; };
struct uint2 { unsigned x, y; };
inline uint4 make_uint4(unsigned x, unsigned y, unsigned z, unsigned w) { return {x, y, z, w}; }
struct bf16 {  // CUDA's __nv_bfloat16 conversions: round to nearest even (inputs are finite)
    unsigned short bits;
    bf16() = default;
    bf16(float f) { unsigned u; std::memcpy(&u, &f, 4); bits = (u + 0x7fff + ((u >> 16) & 1)) >> 16; }
    explicit operator float() const { unsigned u = unsigned(bits) << 16; float f; std::memcpy(&f, &u, 4); return f; }
};
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline int atomicAdd(int* p, int v) { const int old = *p; *p += v; return old; }  // blocks run one at a time
inline void __threadfence() {}
inline float __ldcg(const float* p) { return *p; }
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
struct Dim3 { int x, y, z; };
Dim3 gridDim, blockIdx;
thread_local Dim3 threadIdx;
std::barrier<>* block_barrier;
std::vector<std::unique_ptr<std::barrier<>>> warp_barriers;
float shuffle_slots[64][32];
inline void __syncthreads() { block_barrier->arrive_and_wait(); }
inline void __syncwarp() { warp_barriers[threadIdx.x / 32]->arrive_and_wait(); }
inline float __shfl_xor_sync(unsigned, float v, int lane_mask) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_barriers[warp]->arrive_and_wait();  // the warp's previous exchange has been read
    shuffle_slots[warp][lane] = v;
    warp_barriers[warp]->arrive_and_wait();
    return shuffle_slots[warp][lane ^ lane_mask];
}
inline float __shfl_sync(unsigned, float v, int src_lane) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_barriers[warp]->arrive_and_wait();
    shuffle_slots[warp][lane] = v;
    warp_barriers[warp]->arrive_and_wait();
    return shuffle_slots[warp][src_lane % 32];
}
int vote_slots[64][32];
inline bool __any_sync(unsigned, bool v) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_barriers[warp]->arrive_and_wait();
    vote_slots[warp][lane] = v;
    warp_barriers[warp]->arrive_and_wait();
    for (int l = 0; l < 32; ++l) if (vote_slots[warp][l]) return true;
    return false;
}
// Result byte n is byte (selector nibble n, low 3 bits) of y:x (x the low four bytes).
inline unsigned __byte_perm(unsigned x, unsigned y, unsigned s) {
    const unsigned long long bytes = (unsigned long long)y << 32 | x;
    unsigned r = 0;
    for (int n = 0; n < 4; ++n) r |= unsigned((bytes >> (8 * ((s >> (4 * n)) & 7))) & 0xff) << (8 * n);
    return r;
}
"""

# Tensor-core products as the PTX ISA lays out m16n8k16's fragments: lane L (group g = L / 4,
# q = L % 4) holds A's rows g and g + 8, columns 2q, 2q + 1 (+ 8); B's rows (k) 2q, 2q + 1 (+ 8),
# column g; C's rows g and g + 8, columns 2q, 2q + 1. The warp's lanes meet at a barrier, each
# rebuilds A and B from all 32 lanes' registers and computes its own four sums in float.
_MMA = r"""
unsigned mma_a[64][32][4], mma_b[64][32][2];
inline float bf16_bits(unsigned bits) { unsigned u = bits << 16; float f; std::memcpy(&f, &u, 4); return f; }
inline float half_of(unsigned reg, int hi) { return bf16_bits(hi ? reg >> 16 : reg & 0xffff); }
inline void mma16816(float* c, const unsigned* a, const unsigned* b, const bf16*) {
    const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    warp_barriers[warp]->arrive_and_wait();
    for (int i = 0; i < 4; ++i) mma_a[warp][lane][i] = a[i];
    for (int i = 0; i < 2; ++i) mma_b[warp][lane][i] = b[i];
    warp_barriers[warp]->arrive_and_wait();
    float A[16][16], B[16][8];
    for (int l = 0; l < 32; ++l) {
        const int g = l / 4, q = l % 4;
        for (int e = 0; e < 2; ++e) {
            A[g][2 * q + e] = half_of(mma_a[warp][l][0], e);
            A[g + 8][2 * q + e] = half_of(mma_a[warp][l][1], e);
            A[g][2 * q + 8 + e] = half_of(mma_a[warp][l][2], e);
            A[g + 8][2 * q + 8 + e] = half_of(mma_a[warp][l][3], e);
            B[2 * q + e][g] = half_of(mma_b[warp][l][0], e);
            B[2 * q + 8 + e][g] = half_of(mma_b[warp][l][1], e);
        }
    }
    const int g = lane / 4, q = lane % 4;
    for (int i = 0; i < 4; ++i) {
        const int row = g + (i / 2) * 8, col = 2 * q + i % 2;
        float sum = 0.f;
        for (int k = 0; k < 16; ++k) sum += A[row][k] * B[k][col];
        c[i] += sum;
    }
}
inline unsigned pack2(float lo, float hi, const bf16*) { return unsigned(bf16(lo).bits) | (unsigned(bf16(hi).bits) << 16); }
"""

# Reading a simulated kernel's input arrays from stdin and writing its outputs to stdout.
RUNNER = r"""
template <typename E>
std::vector<E> read_array() {
    long long n;
    if (fread(&n, sizeof n, 1, stdin) != 1) std::abort();
    std::vector<E> v(n);
    if (fread(v.data(), sizeof(E), n, stdin) != size_t(n)) std::abort();
    return v;
}
template <typename E>
void write_array(const std::vector<E>& v) {
    for (const E& x : v) {
        const float f = static_cast<float>(x);
        fwrite(&f, sizeof f, 1, stdout);
    }
}
template <typename F>
void launch(int blocks, int threads, F kernel) {
    gridDim = {blocks, 1, 1};
    for (int block = 0; block < blocks; ++block) {
        blockIdx = {block, 0, 0};
        std::barrier<> sync(threads);
        block_barrier = &sync;
        warp_barriers.clear();
        for (int w = 0; w < threads / 32; ++w) warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> lanes;
        for (int t = 0; t < threads; ++t) lanes.emplace_back([&, t] { threadIdx = {t, 0, 0}; kernel(); });
        for (std::thread& lane : lanes) lane.join();
    }
}
"""

_INT_INPUTS = {"table", "rows", "lengths", "tail_len", "positions"}
_FLOAT_INPUTS = {"scale", "rope_consts", "rope_freqs", "sinks"}


def unavailable() -> str | None:
    """Why kernels cannot be simulated here (no g++, or one without C++20 ``<barrier>``), or None."""
    if shutil.which("g++") is None:
        return "g++ is not installed"
    probe = "#include <barrier>\nint main() { std::barrier<> b(1); b.arrive_and_wait(); }\n"
    with tempfile.TemporaryDirectory() as folder:
        source = Path(folder, "probe.cpp")
        source.write_text(probe)
        built = subprocess.run([*CXX, "-o", str(Path(folder, "probe")), str(source)], capture_output=True, text=True,
                               check=False)
    if built.returncode:
        return f"g++ cannot build C++20 <barrier> code: {built.stderr.strip()[:300]}"
    return None


def _input_type(name: str, elem: str) -> str:
    return "int" if name in _INT_INPUTS else "float" if name in _FLOAT_INPUTS else elem


def program(appending: bool, split: bool, loop: str, elem: str, head_dim: int, n_rep: int, n_kv: int,
            warps: int, unroll: int, edit: Callable[[str], str] | None = None,
            rope: tuple[int, int, bool] | None = None, sinks: bool = False) -> str:
    """A C++ program running one decode step (inputs on stdin, outputs as float32 on stdout);
    ``edit`` rewrites the decode kernel's body first; ``rope`` (mode, dims, traditional): the
    kernel that rotates the queries and new keys; ``sinks``: the kernel with attention sinks."""
    inputs = pk.kernel_inputs(appending, rope is not None, sinks)
    outputs = (["part_acc", "part_m", "part_l"] if split else ["out"]) + (pk.APPEND_OUTPUTS if appending else [])
    params = [f"const {_input_type(name, 'T')}* {name}" for name in inputs]
    params += ["const int* queries_shape", "const int* table_shape", "const int* tail_keys_shape"]
    params += [f"{'float' if name.startswith('part') else 'T'}* {name}" for name in outputs]
    source = (pk.body(appending, loop, rope is not None) + (pk.SINK_MERGE if sinks else "")
              + (pk.WRITE_PARTIAL if split else pk.WRITE_OUT))
    if edit is not None:
        source = edit(source)
    if rope is not None:
        source = (f"constexpr int ROPE = {rope[0]}, ROPE_DIMS = {rope[1]};\n"
                  f"constexpr bool ROPE_TRAD = {str(rope[2]).lower()};\n" + source)
    decode = (f"template <typename T, int D, int NREP, int HKV, int NWARPS, int UNROLL, int GL>\n"
              f"void decode({', '.join(params)}) {{\n{source}\n}}\n")
    combine = ("template <typename T, int D, int NREP>\nvoid combine(const float* part_acc, const float* part_m,"
               f" const float* part_l, const int* part_m_shape, T* out) {{\n{pk.COMBINE}\n}}\n")
    parts = "B * HKV * SPLITS * NREP"
    sizes = {"out": "B * HKV * NREP * D", "part_acc": f"{parts} * D", "part_m": parts, "part_l": parts,
             "keys_out": "B * HKV * RCAP * D", "values_out": "B * HKV * RCAP * D"}
    main = [f"using T = {elem};",
            f"constexpr int D = {head_dim}, NREP = {n_rep}, HKV = {n_kv}, NWARPS = {warps}, UNROLL = {unroll};",
            f"constexpr int GL = {lanes_per_position(head_dim)};",
            "int main() {",
            "    int dims[5];  // rows, table rows, table capacity, tail capacity, splits",
            "    if (fread(dims, sizeof(int), 5, stdin) != 5) return 1;",
            "    const int B = dims[0], RCAP = dims[3], SPLITS = dims[4];",
            "    const int queries_shape[4] = {B, HKV * NREP, 1, D};",
            "    const int table_shape[2] = {dims[1], dims[2]};",
            "    const int tail_keys_shape[4] = {B, HKV, RCAP, D};"]
    main += [f"    const auto {name} = read_array<{_input_type(name, 'T')}>();" for name in inputs]
    main += [f"    std::vector<{'float' if name.startswith('part') else 'T'}> {name}({sizes[name]});"
             for name in outputs + (["out"] if split else [])]
    args = [f"{name}.data()" for name in inputs] + ["queries_shape", "table_shape", "tail_keys_shape"]
    args += [f"{name}.data()" for name in outputs]
    main.append(f"    launch(B * HKV * SPLITS, NWARPS * 32, [&] {{ decode<T, D, NREP, HKV, NWARPS, UNROLL, GL>"
                f"({', '.join(args)}); }});")
    if split:
        main.append("    const int part_m_shape[1] = {B * HKV * SPLITS * NREP};")
        main.append("    launch(B * HKV * NREP, D, [&] { combine<T, D, NREP>(part_acc.data(), part_m.data(),"
                    " part_l.data(), part_m_shape, out.data()); });")
    main += ["    write_array(out);"] + [f"    write_array({name});" for name in pk.APPEND_OUTPUTS if appending]
    main += ["    return 0;", "}"]
    assert pk.MMA in pk.HEADER
    return STUBS + pk.HEADER.replace(pk.MMA, _MMA) + decode + combine + RUNNER + "\n".join(main) + "\n"


@functools.cache
def _build_dir() -> tempfile.TemporaryDirectory:
    return tempfile.TemporaryDirectory(prefix="cuda_sim_")


@functools.cache
def binary(source: str) -> Path:
    """The built program (once per source and process)."""
    name = hashlib.sha256(source.encode()).hexdigest()[:16]
    folder = Path(_build_dir().name)
    path = folder / name
    (folder / f"{name}.cpp").write_text(source)
    built = subprocess.run([*CXX, "-o", str(path), str(path.with_suffix(".cpp"))], capture_output=True, text=True,
                           check=False)
    if built.returncode:
        raise RuntimeError(f"g++ failed on {path}.cpp:\n{built.stderr[:4000]}")
    return path


def bf16_bits(x: np.ndarray) -> np.ndarray:
    """bf16 bit patterns of ``x``, rounded to nearest even."""
    bits = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    """The float32 values of bf16 bit patterns."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run_paged_kernel(loop: str, appending: bool, splits: int, dtype: str = "float", head_dim: int = 128,
                     n_rep: int = 2, n_kv: int = 2, warps: int = 4, unroll: int = 1, rows: int = 2,
                     context: int = 70, tail: int = 3, capacity: int = 6, seed: int = 0,
                     edit: Callable[[str], str] | None = None, full: bool = False,
                     rope: tuple[int, int, bool] | None = None, outputs: list[np.ndarray] | None = None,
                     sinks: bool = False) -> tuple[float, bool]:
    """One simulated decode step of ``rows`` rows, each with up to ``context`` pool positions
    (``tail`` more in a tail of ``capacity``; appending: ``tail - 1`` old ones and the new
    K/V): the largest absolute difference from the reference, and whether the appended tail
    (``keys_out``/``values_out[:, :, :tail]``) is exactly old tail + new row (True when not
    appending). ``dtype`` is the K/V and query type, ``"float"`` or ``"bf16"``; ``full``: every
    row has all ``context`` pool positions (no row shorter, so every split holds some);
    ``rope`` (mode 1 base or 2 frequencies, dims, traditional): the kernel rotates the queries
    and new keys (each row at a random position), against a float64 rotation (the appended
    new row then within a bf16 rounding of it, not exact); ``outputs``: a list the step's output array is appended to;
    ``sinks``: the kernel with one attention-sink logit per query head (drawn, some above every score)."""
    assert dtype in ("float", "bf16") and 1 <= tail <= capacity and (appending or rope is None)
    rng = np.random.default_rng(seed)
    cast = (lambda x: from_bf16_bits(bf16_bits(x))) if dtype == "bf16" else (lambda x: x.astype(np.float32))
    n_q, slots = n_kv * n_rep, rows * context + 5

    def normal(*shape: int) -> np.ndarray:
        return cast(rng.standard_normal(shape))

    queries = normal(rows, n_q, 1, head_dim)
    keys, values = normal(slots, n_kv, head_dim), normal(slots, n_kv, head_dim)
    table = np.zeros((rows + 1, context + 4), np.int32)  # a spare table row, and spare columns
    order = rng.permutation(rows + 1)[:rows].astype(np.int32)
    n_pool = np.full(rows, context) if full else rng.integers(0, context + 1, rows)
    for b in range(rows):
        table[order[b], : n_pool[b]] = rng.choice(np.arange(1, slots), n_pool[b], replace=False)
    tail_k, tail_v = normal(rows, n_kv, capacity, head_dim), normal(rows, n_kv, capacity, head_dim)
    new_k, new_v = normal(rows, n_kv, 1, head_dim), normal(rows, n_kv, 1, head_dim)
    positions = rng.integers(0, 5000, rows).astype(np.int32)
    consts = np.array([0.5, np.log2(10000.0)], np.float32)
    freqs = (1.0 + 100.0 * rng.random(head_dim)).astype(np.float32)
    if rope is not None:  # what the kernel attends with: rotated queries and new keys
        queries_used = cast(_rotated(queries, positions, consts, freqs, *rope))
        new_k_used = cast(_rotated(new_k, positions, consts, freqs, *rope))
    else:
        queries_used, new_k_used = queries, new_k
    if appending:  # the step's tail: old tail[:tail - 1] and the new row
        step_k = np.concatenate([tail_k[:, :, : tail - 1], new_k_used], axis=2)
        step_v = np.concatenate([tail_v[:, :, : tail - 1], new_v], axis=2)
    else:
        step_k, step_v = tail_k[:, :, :tail], tail_v[:, :, :tail]
    scale = np.float32(head_dim**-0.5)
    arrays = {"queries": queries, "keys": keys, "values": values, "table": table, "rows": order,
              "lengths": (n_pool + tail).astype(np.int32), "tail_keys": tail_k, "tail_values": tail_v,
              "tail_len": np.array([tail - 1 if appending else tail], np.int32), "new_keys": new_k,
              "new_values": new_v, "scale": np.array([scale], np.float32), "positions": positions,
              "rope_consts": consts, "rope_freqs": freqs,
              "sinks": (3.0 * rng.standard_normal(n_q)).astype(np.float32)}
    source = program(appending, splits > 1, loop, dtype, head_dim, n_rep, n_kv, warps, unroll, edit, rope, sinks)
    stdin = [np.array([rows, rows + 1, table.shape[1], capacity, splits], np.int32).tobytes()]
    for name in pk.kernel_inputs(appending, rope is not None, sinks):
        a = arrays[name]
        data = bf16_bits(a) if _input_type(name, dtype) == "bf16" else a
        stdin += [np.array([a.size], np.int64).tobytes(), np.ascontiguousarray(data).tobytes()]
    # A timeout: lanes that disagree on which shuffles they reach wait on a barrier forever.
    ran = subprocess.run([str(binary(source))], input=b"".join(stdin), capture_output=True, check=True, timeout=60)
    result = np.frombuffer(ran.stdout, np.float32)
    out = result[: queries.size].reshape(rows, n_q, head_dim)
    if outputs is not None:
        outputs.append(out.copy())

    expected = np.zeros(out.shape)
    for b in range(rows):
        slot_ids = table[order[b], : n_pool[b]]
        for h in range(n_kv):
            k = np.concatenate([keys[slot_ids, h], step_k[b, h]]).astype(np.float64)
            v = np.concatenate([values[slot_ids, h], step_v[b, h]]).astype(np.float64)
            scores = queries_used[b, h * n_rep : (h + 1) * n_rep, 0].astype(np.float64) @ k.T * scale
            if sinks:  # one more logit per query head, with a zero value row
                sink = arrays["sinks"][h * n_rep : (h + 1) * n_rep, None].astype(np.float64)
                scores = np.concatenate([sink, scores], axis=1)
                v = np.concatenate([np.zeros((1, v.shape[1])), v])
            p = np.exp(scores - scores.max(axis=1, keepdims=True))
            expected[b, h * n_rep : (h + 1) * n_rep] = (p / p.sum(axis=1, keepdims=True)) @ v
    tail_exact = True
    if appending:
        keys_out, values_out = result[queries.size :].reshape(2, rows, n_kv, capacity, head_dim)
        tail_exact = bool(np.array_equal(keys_out[:, :, : tail - 1], step_k[:, :, : tail - 1])
                          and np.array_equal(values_out[:, :, :tail], step_v))
        new_row = keys_out[:, :, tail - 1]
        if rope is None:
            tail_exact = tail_exact and bool(np.array_equal(new_row, step_k[:, :, tail - 1]))
        else:  # the sim's cosf / sinf are glibc's, the reference's numpy's: a rounding apart at most
            tail_exact = tail_exact and bool(np.allclose(new_row, step_k[:, :, tail - 1], rtol=1e-2, atol=1e-2))
    return float(np.abs(out - expected).max()), tail_exact


def _rotated(x: np.ndarray, positions: np.ndarray, consts: np.ndarray, freqs: np.ndarray, mode: int, dims: int,
             traditional: bool) -> np.ndarray:
    """``x`` (rows, heads, 1, D) rotated as mx.fast.rope does, row b at ``positions[b]``, in float64."""
    half = dims // 2
    j = np.arange(half)
    inv = 1.0 / freqs[:half].astype(np.float64) if mode == 2 else 2.0 ** (-(j / half) * float(consts[1]))
    theta = float(consts[0]) * positions.astype(np.float64)[:, None, None, None] * inv
    c, s = np.cos(theta), np.sin(theta)
    out = x.astype(np.float64).copy()
    if traditional:
        x1, x2 = out[..., 0:dims:2].copy(), out[..., 1:dims:2].copy()
        out[..., 0:dims:2], out[..., 1:dims:2] = x1 * c - x2 * s, x1 * s + x2 * c
    else:
        x1, x2 = out[..., :half].copy(), out[..., half:dims].copy()
        out[..., :half], out[..., half:dims] = x1 * c - x2 * s, x1 * s + x2 * c
    return out.astype(np.float32)
