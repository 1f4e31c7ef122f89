"""CUDA device helpers of the tensor-core loops (``paged_mma``): the m16n8k16 product, 2-byte
pairs packed into 32-bit registers, and loads of whole 32-bit words. Each is a template, so a
kernel that does not call it does not build it (the mma product needs sm_80 PTX).
"""

from __future__ import annotations

# Tensor-core helpers (the mma loop, sm_80 and later): one m16n8k16 product c += a x b on
# 2-byte inputs with float accumulators, and bf16 / fp16 pairs packed into 32-bit registers.
# The CPU simulator (tests/cuda_sim.py) puts its own versions in place of these.
MMA = """
template <int UNUSED = 0>  // a template: built only where a kernel calls it (sm_80 PTX)
__device__ inline void mma16816(float* c, const unsigned* a, const unsigned* b, const __nv_bfloat16*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <int UNUSED = 0>  // a template: built only where a kernel calls it (sm_80 PTX)
__device__ inline void mma16816(float* c, const unsigned* a, const unsigned* b, const __half*) {
    asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
                 "{%0,%1,%2,%3};" : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
                 : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}
template <int UNUSED = 0>
__device__ inline unsigned pack2(float lo, float hi, const __nv_bfloat16*) {
    __nv_bfloat162 v = __floats2bfloat162_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
template <int UNUSED = 0>
__device__ inline unsigned pack2(float lo, float hi, const __half*) {
    __half2 v = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<unsigned*>(&v);
}
"""

# Both 2-byte elements' bits in one register, ``lo`` in the low half (as mma fragments hold them).
RAW2 = """
template <typename T>
__device__ inline unsigned raw2(const T& lo, const T& hi) {
    return unsigned(*reinterpret_cast<const unsigned short*>(&lo)) |
           (unsigned(*reinterpret_cast<const unsigned short*>(&hi)) << 16);
}
"""

# C adjacent 32-bit words of 2-byte elements from p (4 C-byte aligned where ``aligned``: one
# 16-, 8- or 4-byte load; else element by element).
LOAD_CHUNK = """
template <int C, typename T>
__device__ inline void load_chunk(const T* p, unsigned* w, bool aligned) {
    if (aligned && C == 4) {
        const uint4 v = *reinterpret_cast<const uint4*>(p);
        w[0] = v.x;
        w[C > 1 ? 1 : 0] = v.y;
        w[C > 2 ? 2 : 0] = v.z;
        w[C > 3 ? 3 : 0] = v.w;
    } else if (aligned && C == 2) {
        const uint2 v = *reinterpret_cast<const uint2*>(p);
        w[0] = v.x;
        w[C > 1 ? 1 : 0] = v.y;
    } else if (aligned) {
        w[0] = *reinterpret_cast<const unsigned*>(p);
    } else {
#pragma unroll
        for (int c = 0; c < C; ++c) w[c] = raw2(p[2 * c], p[2 * c + 1]);
    }
}
"""
