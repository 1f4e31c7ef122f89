"""The gated delta rule (Qwen3-Next's, Qwen3.5's, Kimi Linear's delta-net layers) as one
CUDA kernel over all of its tokens.

mlx-lm runs the recurrence as one Metal kernel on a Mac; elsewhere (``gated_delta_ops``) as a
Python loop of about eight MLX operations a token and layer, so on a CUDA GPU a 512-token prefill
chunk of a 48-layer hybrid is some 150,000 kernels, each encoded by the host (session 37's
``qn-mixed``, Qwen3-Next widths at 10 requests/s on an H100, had 100 of 364 requests done after
221 s). This kernel is mlx-lm's Metal one
in CUDA: a warp per (row, value head, value dim), each lane holding ``Dk / 32`` of that state
row in registers for the whole prompt, token after token, with the ops path's float32
arithmetic (the decay, ``k . s``, the delta, the update, ``q . s``), its dot products summed
lane by lane and then across the warp (MLX's reductions sum in another order, so the outputs
are not MLX's bits: like every GPU kernel here, tokens may part from mlx-lm's at near-ties).
A padded position (``mask`` false) keeps the state, as the ops path's ``where`` does.

The worker's prefill and decode forwards take it (``GatedDeltaKernel.scope`` around their
builds, and around the decode traces a compiled step replays): a decode step's one token is one
launch a layer instead of about ten, and reads and writes each state once instead of about five
times. The worker checks the kernel against the ops path at start-up, at the shapes the model
calls it with (``gated_delta_check``), and keeps the ops path if they differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import mlx.core as mx
from mlx_lm.models.gated_delta import gated_delta_ops as _mlx_gated_delta_ops

from runtime.worker.paths.cuda.cubin_kernels import cuda_kernel

WARPS = 4  # value dims (warps) a block: blocks of 128 threads

# Template parameters: InT (q, k, v, y), GT (g), BT (beta), StT (the state), Dk, Dv, Hk, Hv.
# Markers: {G_AT} a lane's decay for its state element i, {G_STEP} the decay's advance a token,
# {KEEP} whether position t updates the state (the mask).
SOURCE = """
    constexpr int PER = Dk / 32;  // state elements a lane holds
    constexpr int NWARPS = WARPS_PER_BLOCK;
    const int n = blockIdx.x / (Dv / NWARPS);  // (row, value head)
    const int dv = (blockIdx.x % (Dv / NWARPS)) * NWARPS + threadIdx.x / 32;
    const int lane = threadIdx.x % 32;
    const int b = n / Hv;
    const int hv = n % Hv;
    const int hk = hv / (Hv / Hk);
    const int T = q_shape[1];
    const InT* qp = q + ((size_t)b * T * Hk + hk) * Dk + lane * PER;
    const InT* kp = k + ((size_t)b * T * Hk + hk) * Dk + lane * PER;
    const InT* vp = v + ((size_t)b * T * Hv + hv) * Dv + dv;
    const BT* bp = beta + (size_t)b * T * Hv + hv;
    {G_START}
    InT* yp = y + ((size_t)b * T * Hv + hv) * Dv + dv;
    const size_t srow = ((size_t)n * Dv + dv) * Dk + lane * PER;
    float s[PER];
#pragma unroll
    for (int i = 0; i < PER; ++i) s[i] = static_cast<float>(state_in[srow + i]);
    // Token t + 1's inputs are loaded while token t is computed: the loop waits on the state only.
    // (Iteration -1 loads token 0 and computes nothing.)
    float kk[PER], qq[PER], gg[PER], vv = 0.f, bb = 0.f;
    for (int t = -1; t < T; ++t) {
        float kn[PER], qn[PER], gn[PER], vn = 0.f, bn = 0.f;
#pragma unroll
        for (int i = 0; i < PER; ++i) kn[i] = qn[i] = gn[i] = 0.f;
        if (t + 1 < T) {
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                kn[i] = static_cast<float>(kp[i]);
                qn[i] = static_cast<float>(qp[i]);
                gn[i] = static_cast<float>({G_AT});
            }
            vn = static_cast<float>(*vp);
            bn = static_cast<float>(*bp);
            qp += Hk * Dk;
            kp += Hk * Dk;
            vp += Hv * Dv;
            bp += Hv;
            {G_STEP}
        }
        if (t >= 0) {
            float sn[PER];
            float kv = 0.f;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                sn[i] = __fmul_rn(s[i], gg[i]);
                kv = __fadd_rn(kv, __fmul_rn(sn[i], kk[i]));
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) kv += __shfl_xor_sync(0xffffffff, kv, off);
            const float delta = __fmul_rn(__fsub_rn(vv, kv), bb);
            float out = 0.f;
#pragma unroll
            for (int i = 0; i < PER; ++i) {
                sn[i] = __fadd_rn(sn[i], __fmul_rn(kk[i], delta));
                out = __fadd_rn(out, __fmul_rn(sn[i], qq[i]));
            }
#pragma unroll
            for (int off = 16; off > 0; off >>= 1) out += __shfl_xor_sync(0xffffffff, out, off);
            if (lane == 0) *yp = static_cast<InT>(out);
            yp += Hv * Dv;
            if ({KEEP}) {
#pragma unroll
                for (int i = 0; i < PER; ++i) s[i] = sn[i];
            }
        }
#pragma unroll
        for (int i = 0; i < PER; ++i) {
            kk[i] = kn[i];
            qq[i] = qn[i];
            gg[i] = gn[i];
        }
        vv = vn;
        bb = bn;
    }
#pragma unroll
    for (int i = 0; i < PER; ++i) state_out[srow + i] = static_cast<StT>(s[i]);
""".replace("WARPS_PER_BLOCK", str(WARPS))

_G = {  # the decay: one a (token, value head), or one a state column (Kimi Linear's)
    False: ("const GT* gp = g + (size_t)b * T * Hv + hv;", "gp[0]", "gp += Hv;"),
    True: ("const GT* gp = g + ((size_t)b * T * Hv + hv) * Dk + lane * PER;", "gp[i]", "gp += Hv * Dk;"),
}


def source(vectorized: bool, masked: bool) -> str:
    """The kernel's body for a decay per head or per state column, with or without a mask."""
    start, at, step = _G[vectorized]
    keep = "mask[(size_t)b * T + t]" if masked else "true"
    return SOURCE.replace("{G_START}", start).replace("{G_AT}", at).replace("{G_STEP}", step).replace("{KEEP}", keep)


def input_names(masked: bool) -> list[str]:
    return ["q", "k", "v", "g", "beta", "state_in"] + (["mask"] if masked else [])


def ops_path(q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None,
             mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
    """mlx-lm's own ``gated_delta_ops`` (the one it ships, whatever a scope has put in its place)."""
    return _mlx_gated_delta_ops(q, k, v, g, beta, state, mask)


@contextlib.contextmanager
def in_place_of_ops(replacement: Callable[..., tuple[mx.array, mx.array]]) -> Iterator[None]:
    """``replacement`` in the place of ``mlx_lm.models.gated_delta.gated_delta_ops`` (which
    ``gated_delta_update`` calls off a Mac) inside; refuses nesting."""
    from mlx_lm.models import gated_delta

    if gated_delta.gated_delta_ops is not _mlx_gated_delta_ops:
        raise RuntimeError("the delta-net ops path is replaced already: scopes do not nest")
    gated_delta.gated_delta_ops = replacement
    try:
        yield
    finally:
        gated_delta.gated_delta_ops = _mlx_gated_delta_ops


class GatedDeltaKernel:
    """mlx-lm's ``gated_delta_ops`` as the kernel where ``use_kernel`` and the shapes allow it.

    ``scope()`` puts ``__call__`` in the place of ``mlx_lm.models.gated_delta.gated_delta_ops``
    while a forward is being built (``in_place_of_ops``); outside it mlx-lm is as shipped."""

    def __init__(self, use_kernel: bool) -> None:
        self.use_kernel = use_kernel
        self.problem: str | None = None  # why the kernel was dropped at start-up (``check``), if it was
        self._kernels: dict[tuple[bool, bool], object] = {}

    def applies(self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                state: mx.array | None, mask: mx.array | None = None) -> bool:
        """Whether the kernel takes these inputs (else the ops path does): key dims in whole warps
        of lanes, value dims in whole blocks, q, k and v of one float dtype, a decay per head or
        per state column, a (rows, tokens) mask."""
        if not self.use_kernel or q.ndim != 4 or v.ndim != 4:
            return False
        batch, steps, hk, dk = k.shape
        hv, dv = v.shape[-2:]
        floats = (mx.float32, mx.float16, mx.bfloat16)
        return (dk % 32 == 0 and dv % WARPS == 0 and hv % hk == 0 and q.shape == k.shape
                and v.shape[:2] == (batch, steps) and q.dtype == k.dtype == v.dtype
                and g.shape in ((batch, steps, hv), (batch, steps, hv, dk)) and beta.shape == (batch, steps, hv)
                and all(a.dtype in floats for a in (q, g, beta))
                and (state is None or (state.shape == (batch, hv, dv, dk) and state.dtype in floats))
                and (mask is None or mask.shape == (batch, steps)))

    def __call__(self, q: mx.array, k: mx.array, v: mx.array, g: mx.array, beta: mx.array,
                 state: mx.array | None = None, mask: mx.array | None = None) -> tuple[mx.array, mx.array]:
        if not self.applies(q, k, v, g, beta, state, mask):
            return ops_path(q, k, v, g, beta, state, mask)
        batch, steps, hk, dk = q.shape
        hv, dv = v.shape[-2:]
        if state is None:
            state = mx.zeros((batch, hv, dv, dk), dtype=mx.float32)
        vectorized, masked = g.ndim == 4, mask is not None
        kernel = self._kernels.get((vectorized, masked))
        if kernel is None:
            kernel = self._kernels[(vectorized, masked)] = cuda_kernel(
                name=f"runtime_gated_delta{'_vec' if vectorized else ''}{'_mask' if masked else ''}",
                input_names=input_names(masked), output_names=["y", "state_out"], source=source(vectorized, masked))
        inputs = [q, k, v, g, beta, state] + ([mask.astype(mx.bool_)] if masked else [])
        blocks = batch * hv * (dv // WARPS)
        y, new_state = kernel(
            inputs=inputs,
            template=[("InT", q.dtype), ("GT", g.dtype), ("BT", beta.dtype), ("StT", state.dtype), ("Dk", dk),
                      ("Dv", dv), ("Hk", hk), ("Hv", hv)],
            grid=(blocks * WARPS * 32, 1, 1), threadgroup=(WARPS * 32, 1, 1),
            output_shapes=[(batch, steps, hv, dv), state.shape], output_dtypes=[q.dtype, state.dtype])
        return y, new_state

    @contextlib.contextmanager
    def scope(self) -> Iterator[None]:
        """The kernel in the place of mlx-lm's ops path for the forwards built inside (nothing
        where the kernel is not used); refuses nesting."""
        if not self.use_kernel:
            yield
            return
        with in_place_of_ops(self):
            yield
