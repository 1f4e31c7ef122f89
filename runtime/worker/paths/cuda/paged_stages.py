"""CUDA sources of the paged decode kernel's optional stages (``paged_kernels.body`` puts them
in): the RoPE of the step's queries and new keys before the loop.

A stage that merged a split launch's partial results in its last block (one kernel a layer, no
combine kernel) was measured on an H100 in session 28 and removed: 1.2-1.7x slower than the split
kernel with the combine kernel at one row (114.7 against 67.3 us at 32k, 53.6 against 41.9 at
8k), its last block merging every split alone.
"""

from __future__ import annotations

# RoPE of the step's queries and new key, done here rather than by two MLX rope kernels a layer
# (on a one-row step those launches are host time that the GPU waits for). The float operations
# are MLX's CUDA rope kernel's, in its order: L = scale * offset, inv_freq = exp2(-d * log2(base))
# with d = j / (dims / 2) (or 1.0 / freqs[j] in double), theta = L * inv_freq, x1 cos - x2 sin and
# x1 sin + x2 cos, rounded to T; dims past ROPE_DIMS pass unchanged. The worker's start-up check
# compares the rotated keys with mx.fast.rope's bit for bit and keeps MLX's rope if they differ.
# The rotated rows are staged in shared memory for the loops and the tail copy.
ROPE_STAGE = """    __shared__ __align__(16) T rope_q[NREP * D];
    __shared__ __align__(16) T rope_k[D];
    {
        constexpr int HALF = ROPE_DIMS / 2;
        const float at = rope_consts[0] * static_cast<float>(positions[b]);
        // One thread per rotated pair: its angle once, for the group's query heads and the key.
        for (int j = threadIdx.x; j < HALF; j += NWARPS * 32) {
            float inv_freq;
            if (ROPE == 2) {
                inv_freq = 1.0 / rope_freqs[j];
            } else {
                const float d = static_cast<float>(j) / static_cast<float>(HALF);
                inv_freq = exp2f(-d * rope_consts[1]);
            }
            const float theta = at * inv_freq;
            const float costheta = cosf(theta);
            const float sintheta = sinf(theta);
            const int i1 = ROPE_TRAD ? 2 * j : j;
            const int i2 = i1 + (ROPE_TRAD ? 1 : HALF);
            for (int r = 0; r <= NREP; ++r) {
                const T* src = r < NREP ? qblock + (size_t)r * D : new_keys_row;
                T* dst = r < NREP ? rope_q + r * D : rope_k;
                const float x1 = static_cast<float>(src[i1]);
                const float x2 = static_cast<float>(src[i2]);
                // MLX writes x1 cos - x2 sin and x1 sin + x2 cos; its build fuses each first product
                // with the sum (found on an H100 with MLX 0.32.4: this form matched all of 650k
                // elements, the other roundings, NVRTC's own choice for the plain expression
                // included, parted in a few; docs/runs/h100-s27-w4-rope-bits-forms.log).
                dst[i1] = static_cast<T>(__fmaf_rn(x1, costheta, -__fmul_rn(x2, sintheta)));
                dst[i2] = static_cast<T>(__fmaf_rn(x1, sintheta, __fmul_rn(x2, costheta)));
            }
        }
        for (int e = threadIdx.x; e < (NREP + 1) * (D - ROPE_DIMS); e += NWARPS * 32) {  // dims past the rotated ones
            const int r = e / (D - ROPE_DIMS);
            const int i = ROPE_DIMS + e % (D - ROPE_DIMS);
            (r < NREP ? rope_q + r * D : rope_k)[i] = (r < NREP ? qblock + (size_t)r * D : new_keys_row)[i];
        }
        __syncthreads();
        qblock = rope_q;
        new_keys_row = rope_k;
    }
"""
