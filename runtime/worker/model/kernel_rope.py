"""RoPE done by the paged decode kernel instead of two MLX rope kernels per layer.

A one-row decode step on a GPU is host-bound: each kernel MLX launches costs host time the
GPU then waits for, and the rotations of the queries and the new keys are two of a layer's
dozen launches. Where an attention layer's rotary module is one whose arithmetic is known
(``nn.RoPE`` and subclasses that keep its call: a base; mlx-lm's ``Llama3RoPE``:
frequencies), the compiled paged decode step hands the layer a ``DeferredOffset`` as its
cache offset; the rotary module, wrapped in ``DeferrableRoPE``, then returns its input
unrotated, and the kernel rotates the queries and the new keys as MLX's rope kernel does
(``paged_stages.ROPE_STAGE``).

That is only right where the attention module rotates exactly its queries and keys with that
module and does nothing else with the offset or the rotated arrays before the attention call.
``defer_rope`` runs each kind of attention module once both ways at load and keeps the
deferral only where the two agree bit for bit (``rope_probe``); every other model keeps its
own rotation. Layers whose rotary module the kernel does not know (or that have none) keep their
own rotation beside deferred ones; a layer whose module rotated nothing in a step gets the
kernel that does not rotate (``compiled_paged``).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.model.discovery import CacheLayout, model_layers, submodule
from runtime.worker.model.mask_probe import behaviour_key

ROPE_ATTR = "rope"  # the rotary module's attribute on mlx-lm's attention modules
BASE, FREQS = 1, 2  # the kernel's ROPE modes


@dataclass(frozen=True, eq=False)
class RopeSpec:
    """One rotary module's ``mx.fast.rope`` arguments, and the kernel's inputs for them."""

    mode: int  # BASE or FREQS
    dims: int
    traditional: bool
    scale: float
    base: float | None  # BASE: the rope base
    freqs: mx.array | None  # FREQS: the frequencies (dims / 2,), float32

    @property
    def consts(self) -> mx.array:
        """[scale, log2(base)] as MLX's rope kernel gets them (0 for log2(base) under FREQS)."""
        return _consts(self.scale, self.base)

    @property
    def freqs_input(self) -> mx.array:
        return self.freqs if self.freqs is not None else _no_freqs()

    def rotate(self, x: mx.array, offset: mx.array) -> mx.array:
        """What the module itself computes: ``mx.fast.rope`` with these arguments."""
        return mx.fast.rope(x, self.dims, traditional=self.traditional, base=self.base, scale=self.scale,
                            offset=offset, freqs=self.freqs)


@functools.cache
def _consts(scale: float, base: float | None) -> mx.array:
    return mx.array([scale, _log2f(base) if base is not None else 0.0], dtype=mx.float32)


@functools.cache
def _no_freqs() -> mx.array:
    return mx.zeros((1,), dtype=mx.float32)


def _log2f(base: float) -> float:
    """``std::log2`` of ``base`` as a float32, as MLX's host code computes it for its kernel
    (libm's ``log2f``; numpy's float64 log2 rounded to float32 where there is no libm)."""
    name = ctypes.util.find_library("m")
    if name:
        log2f = ctypes.CDLL(name).log2f
        log2f.restype, log2f.argtypes = ctypes.c_float, [ctypes.c_float]
        return float(log2f(base))
    import numpy as np

    return float(np.float32(np.log2(np.float64(np.float32(base)))))


def rope_spec(module: object) -> RopeSpec | None:
    """The spec of a rotary module the kernel can stand in for, else None."""
    kind = type(module)
    if isinstance(module, nn.RoPE) and kind.__call__ is nn.RoPE.__call__:  # FixedBaseRoPE (InternLM) too
        return RopeSpec(BASE, int(module.dims), bool(module.traditional), float(module.scale), float(module.base), None)
    if kind.__name__ == "Llama3RoPE" and kind.__module__ == "mlx_lm.models.rope_utils":
        freqs = module._freqs.astype(mx.float32)
        if freqs.shape != (module.dims // 2,):
            return None
        return RopeSpec(FREQS, int(module.dims), bool(module.traditional), 1.0, None, mx.contiguous(freqs))
    return None


class DeferredOffset:
    """A layer's cache offset in a step whose kernel rotates: the positions, and how many
    times the layer's ``DeferrableRoPE`` was asked to rotate with it (two: queries and keys)."""

    def __init__(self, positions: mx.array) -> None:
        self.positions = positions
        self.calls = 0


class DeferrableRoPE(nn.Module):
    """A rotary module that leaves its input as it is when handed a ``DeferredOffset``."""

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if isinstance(offset, DeferredOffset):
            offset.calls += 1
            return x
        return self.inner(x, offset=offset)


def defer_rope(model: nn.Module, layout: CacheLayout) -> tuple[RopeSpec | None, ...] | None:
    """Wrap the rotary module of every attention layer the kernel can stand in for in
    ``DeferrableRoPE`` and return each KV-pool layer's spec, None for a layer that keeps its own
    rotation (no rotary module, NoPE, or one of arithmetic the kernel does not know: such a
    layer's step gets the positions as its offset, as before). ``rope_probe`` must agree for
    each kind of wrapped attention module (``behaviour_key``: a layer whose flags differ is a
    kind of its own); else, or where no layer can defer, change nothing and return None.
    (``attention_patch`` must be installed: the probe's attention call reaches its cache so.)"""
    from runtime.worker.model.rope_probe import agrees  # it imports this module

    layers = model_layers(model)
    if len(layout.kv_index) != len(layers) or not layout.attention_layers:
        return None
    modules: dict[int, nn.Module] = {}  # KV-pool layer -> attention module
    for entry, (layer, name) in enumerate(zip(layers, layout.attn_attr)):
        if name is not None and layout.kv_index[entry] >= 0:
            modules[layout.kv_index[entry]] = submodule(layer, name)
    if sorted(modules) != list(range(len(layout.attention_layers))):
        return None
    own = {kv: getattr(m, ROPE_ATTR, None) for kv, m in modules.items()}
    own = {kv: r.inner if isinstance(r, DeferrableRoPE) else r for kv, r in own.items()}
    specs = {kv: rope_spec(r) for kv, r in own.items()}
    deferred = {kv: m for kv, m in modules.items() if specs[kv] is not None}
    if not deferred:
        return None
    for kv, module in deferred.items():
        setattr(module, ROPE_ATTR, DeferrableRoPE(own[kv]))
    probed: set[tuple] = set()
    for kv, module in deferred.items():
        key = behaviour_key(module)  # the same classes and plain attributes: the same code path
        if key in probed:
            continue
        probed.add(key)
        if not agrees(module, specs[kv]):
            for k, m in deferred.items():
                setattr(m, ROPE_ATTR, own[k])
            return None
    return tuple(specs[kv] for kv in range(len(modules)))
