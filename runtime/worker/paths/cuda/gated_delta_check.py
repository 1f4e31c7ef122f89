"""Whether a model's delta-net layers take the CUDA kernel: its start-up check, at the shapes the
model calls the kernel with.

The kernel's template (head counts and widths, dtypes) and variant (a decay per head or per state
column, a mask or none) are set by the model, not by the batch or the prompt's length. A small
recorded forward (``model_calls``: a padded prompt, a decode step after it, an unpadded prompt)
says which the model uses. ``check`` then starts their NVRTC builds side by side where our kernels'
modules are written ahead (``cubin_kernels.prefetching``), and compares each with mlx-lm's ops path
on random inputs of those shapes. So every build happens at start-up, in parallel, and none at a
first request; a first start on a host took 14.0 s of serial builds at fixed shapes before
(session 38, Qwen3-Next's widths on an H100).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.model.discovery import CacheLayout
from runtime.worker.model.padding_probe import recurrent_caches
from runtime.worker.paths.cuda.cubin_kernels import prefetching
from runtime.worker.paths.cuda.gated_delta import GatedDeltaKernel, in_place_of_ops, ops_path


@dataclass(frozen=True)
class DeltaCall:
    """What of a call decides the kernel it runs: widths, head counts, dtypes, and variant."""

    hk: int
    dk: int
    hv: int
    dv: int
    dtype: mx.Dtype  # q, k and v
    g_dtype: mx.Dtype
    beta_dtype: mx.Dtype
    state_dtype: mx.Dtype
    vectorized: bool  # a decay per state column (Kimi Linear), else one per head
    masked: bool

    @classmethod
    def of(cls, q: mx.array, v: mx.array, g: mx.array, beta: mx.array, state: mx.array | None,
           mask: mx.array | None) -> DeltaCall:
        return cls(q.shape[2], q.shape[3], v.shape[2], v.shape[3], q.dtype, g.dtype, beta.dtype,
                   state.dtype if state is not None else mx.float32, g.ndim == 4, mask is not None)


# Where a model's calls cannot be recorded: small shapes of every variant.
SMALL = tuple(DeltaCall(2, 64, 4, 32, mx.bfloat16, mx.float32, mx.bfloat16, mx.float32, vectorized, masked)
              for vectorized, masked in ((False, False), (False, True), (True, False)))


def model_calls(model: nn.Module, layout: CacheLayout) -> tuple[DeltaCall, ...]:
    """The kernel calls of ``model``'s forwards: a prompt padded at the end (its recurrent caches
    told the real lengths), a decode step after it, and an unpadded prompt; ``SMALL`` where the
    model cannot run so."""
    calls: dict[DeltaCall, None] = {}

    def record(q, k, v, g, beta, state=None, mask=None):
        calls[DeltaCall.of(q, v, g, beta, state, mask)] = None
        return ops_path(q, k, v, g, beta, state, mask)

    tokens = mx.array([[5, 6, 7], [8, 9, 10]], dtype=mx.int32)
    try:
        with in_place_of_ops(record):
            padded = model.make_cache()
            for cache in recurrent_caches(padded, layout):
                cache.prepare(lengths=[2, 3])
            mx.eval(model(tokens, cache=padded))
            for cache in recurrent_caches(padded, layout):
                cache.finalize()
            mx.eval(model(tokens[:, :1], cache=padded))
            mx.eval(model(tokens, cache=model.make_cache()))
    except Exception as exc:  # noqa: BLE001 - the check still runs, at small shapes
        print(f"runtime worker: the delta-net kernel's calls could not be recorded ({str(exc)[:200]}); "
              "it is checked at small shapes", file=sys.stderr, flush=True)
        return SMALL
    return tuple(calls) or SMALL


def _inputs(call: DeltaCall, batch: int, steps: int, key: mx.array) -> tuple:
    keys = mx.random.split(key, 6)
    q = (mx.random.normal((batch, steps, call.hk, call.dk), key=keys[0]) * call.dk**-0.5).astype(call.dtype)
    k = (mx.random.normal((batch, steps, call.hk, call.dk), key=keys[1]) * call.dk**-0.5).astype(call.dtype)
    v = mx.random.normal((batch, steps, call.hv, call.dv), key=keys[2]).astype(call.dtype)
    g_shape = (batch, steps, call.hv) + ((call.dk,) if call.vectorized else ())
    g = mx.exp(-mx.exp(mx.random.normal(g_shape, key=keys[3]) - 2)).astype(call.g_dtype)
    beta = mx.sigmoid(mx.random.normal((batch, steps, call.hv), key=keys[4])).astype(call.beta_dtype)
    state = (mx.random.normal((batch, call.hv, call.dv, call.dk), key=keys[5]) * 0.1).astype(call.state_dtype)
    mask = (mx.arange(steps)[None, :] < mx.array([[steps], [steps - 5]])) if call.masked else None
    return q, k, v, g, beta, state, mask


def check(kernel: GatedDeltaKernel, calls: tuple[DeltaCall, ...], steps: int = 37) -> str | None:
    """None where the kernel's outputs are within float rounding of the ops path's for every one
    of ``calls`` (random inputs, two rows, the second with 5 masked positions where masked), else
    what differed; the kernel is then not used."""
    key = mx.random.key(11)
    with prefetching() as ahead:  # every build started at once, in build processes
        if ahead:
            for call in calls:
                kernel(*_inputs(call, 2, steps, key))
    for call in calls:
        inputs = _inputs(call, 2, steps, key)
        if not kernel.applies(*inputs):
            continue  # such calls take the ops path
        try:
            got = kernel(*inputs)
            mx.eval(*got)
        except Exception as exc:  # noqa: BLE001 - a kernel that cannot build or run is not used
            return f"the kernel failed: {str(exc)[:200]}"
        want = ops_path(*inputs)
        for name, a, b, tol in (("output", got[0], want[0], 2e-2), ("state", got[1], want[1], 1e-4)):
            err = mx.abs(a.astype(mx.float32) - b.astype(mx.float32)).max().item()
            scale = mx.abs(b.astype(mx.float32)).max().item()
            if not err <= tol * max(scale, 1.0):
                return f"the {name} differs from the ops path's by {err:.3g} (scale {scale:.3g}) at {call}"
    return None


def kernel_for(model: nn.Module, layout: CacheLayout, on_cuda: bool) -> GatedDeltaKernel:
    """The kernel for a model whose layers call mlx-lm's ``gated_delta_update``, on a CUDA GPU,
    where ``check`` passes at the model's own calls (else the ops path, and ``problem`` says why)."""
    uses = any(hasattr(sys.modules.get(type(m).__module__), "gated_delta_update") for m in model.modules())
    kernel = GatedDeltaKernel(on_cuda and uses)
    if kernel.use_kernel:
        kernel.problem = check(kernel, model_calls(model, layout))
        kernel.use_kernel = kernel.problem is None
    return kernel
