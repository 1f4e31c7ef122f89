"""Recognise a layer's softmax attention by how it uses a KV cache, not by attribute names.

A module is attention for the runtime when, called as ``module(x, mask=None, cache=c)`` (the
mask under the name its call gives it) with
a cache that offers only what the worker's KV stand-ins offer (``offset``,
``update_and_fetch``), it stores one (B, kv_heads, L, head_dim) key and value tensor through
``c.update_and_fetch`` and returns an output of its input's shape. Whether it then attends
through its Python module's ``scaled_dot_product_attention`` (the call ``attention_patch``
routes to the pool) is recorded too, with the queries' head count.

The probe only builds the graph (nothing is evaluated), so it reads no lazily loaded weight:
shapes and dtypes are known without running anything. A recurrent mixer indexes its cache
(``cache[0]``), which the probe cache refuses, so it never passes (SPEC 1.2); fused
projections (``qkv_proj``, ``query_key_value``) and any output projection name pass alike,
and so does a module that returns its output with state for later layers (``(out, kv)``).
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

PROBE_LENGTH = 2  # tokens in the probe input: the L axis of the stored K/V


@dataclass(frozen=True)
class ProbedAttention:
    """What one probe of an attention module showed.

    ``width``: the input width the module accepted; ``kv_heads``/``head_dim``/``value_dim``:
    the stored K/V's geometry; ``dtype``: their dtype; ``query_heads``: the queries' head count
    where the module's attention call was seen, else None; ``defines_call``: the module's
    Python module has a ``scaled_dot_product_attention`` that ``attention_patch`` would
    replace; ``routed``: the module calls it with the probe cache and the K/V it fetched;
    ``sinks``: that call passes attention-sink logits (gpt-oss).
    """

    width: int
    kv_heads: int
    head_dim: int
    value_dim: int
    dtype: mx.Dtype
    query_heads: int | None
    defines_call: bool
    routed: bool
    sinks: bool = False


class _ProbeCache:
    """A KV cache with nothing but ``offset`` and ``update_and_fetch``; records what is stored."""

    offset = 0

    def __init__(self) -> None:
        self.stored: list[tuple[mx.array, mx.array]] = []

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.stored.append((keys, values))
        return keys, values


@contextmanager
def _recorded_attention(py_module: object, calls: list[tuple]) -> Iterator[bool]:
    """Record calls of ``py_module.scaled_dot_product_attention`` while inside; whether it has one.

    The same name ``attention_patch.install`` replaces, so what is seen here is what it routes.
    """
    original = getattr(py_module, "scaled_dot_product_attention", None)
    if not callable(original):
        yield False
        return

    def recording(queries, keys, values, *args, **kwargs):
        cache = kwargs.get("cache", args[0] if args else None)
        calls.append((queries, keys, values, cache, kwargs.get("sinks")))
        return original(queries, keys, values, *args, **kwargs)

    setattr(py_module, "scaled_dot_product_attention", recording)
    try:
        yield True
    finally:
        setattr(py_module, "scaled_dot_product_attention", original)


def takes_cache(module: nn.Module) -> bool:
    """Whether the module's call has a ``cache`` parameter (MLPs and norms do not)."""
    call = getattr(type(module), "__call__", None)
    if call is None:
        return False
    try:
        return "cache" in inspect.signature(call).parameters
    except (TypeError, ValueError):
        return False


def _parameters(module: nn.Module) -> set[str]:
    try:
        return set(inspect.signature(type(module).__call__).parameters)
    except (TypeError, ValueError):
        return set()


def _required_extras(module: nn.Module) -> list[str]:
    """Parameters of the module's call after the input that have no default and are neither
    the mask nor the cache (Mistral 4's query scale, computed once per forward by its model)."""
    try:
        params = list(inspect.signature(type(module).__call__).parameters.values())[2:]
    except (TypeError, ValueError):
        return []
    kinds = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return [p.name for p in params if p.kind in kinds and p.default is inspect.Parameter.empty
            and p.name not in ("mask", "attention_mask", "cache")]


def call_attention(module: nn.Module, x: mx.array, mask: mx.array | None, cache: object) -> object:
    """``module(x, mask=..., cache=...)``, with the mask under the name the module's call gives
    it (``mask``, or ``attention_mask`` as PLaMo's); never positionally (Ministral 3's second
    parameter is a query scale). A required extra input gets a scalar one: the probes read
    shapes and what the mask hides, never the scale of the output."""
    names = _parameters(module)
    mask_name = "attention_mask" if "mask" not in names and "attention_mask" in names else "mask"
    extras = {name: mx.array(1.0, dtype=x.dtype) for name in _required_extras(module)}
    return module(x, cache=cache, **{mask_name: mask}, **extras)


# Tensor-parallel ranks (``worker/ranks.py``) see mlx's sharded linear layers in their place.
_LINEAR_TYPES = (nn.Linear, nn.QuantizedLinear, nn.AllToShardedLinear, nn.ShardedToAllLinear,
                 nn.QuantizedAllToShardedLinear, nn.QuantizedShardedToAllLinear)


def _linears(module: nn.Module) -> list[nn.Module]:
    return [m for _, m in module.named_modules() if isinstance(m, _LINEAR_TYPES)]


def input_widths(module: nn.Module) -> list[int]:
    """The input widths of the module's linear layers (one of them is the module's own)."""
    widths: list[int] = []
    for linear in _linears(module):
        width = linear.weight.shape[1]
        if hasattr(linear, "bits"):  # quantized (plain or sharded): packed uint32 columns
            width = width * 32 // linear.bits
        if width not in widths:
            widths.append(width)
    return widths


def compute_dtype(module: nn.Module, fallback: mx.Dtype) -> mx.Dtype:
    """A float dtype the module computes in, even when its projections are quantized (uint32
    weights): a linear layer's weight or scales, else any float parameter."""
    arrays = [lin[k] for lin in _linears(module) for k in ("weight", "scales") if k in lin]
    arrays += [a for _, a in tree_flatten(module.parameters())]
    for arr in arrays:
        if isinstance(arr, mx.array) and mx.issubdtype(arr.dtype, mx.floating):
            return arr.dtype
    return fallback


def probe_attention(module: nn.Module, dtype: mx.Dtype = mx.float32) -> ProbedAttention | None:
    """The probe of ``module`` as a KV-cache attention module, or None when it is not one."""
    if not takes_cache(module):
        return None
    dtype = compute_dtype(module, dtype)
    py_module = sys.modules.get(type(module).__module__)
    for width in input_widths(module):
        cache, calls = _ProbeCache(), []
        x = mx.zeros((1, PROBE_LENGTH, width), dtype=dtype)
        with _recorded_attention(py_module, calls) as defines_call:
            try:
                out = call_attention(module, x, None, cache)
            except Exception:  # a shape that does not fit, or a cache used another way
                continue
        if isinstance(out, tuple) and out:
            out = out[0]  # (output, state for later layers): Hunyuan hands its K/V projections on
        if len(cache.stored) != 1 or not isinstance(out, mx.array) or out.shape != x.shape:
            continue
        keys, values = cache.stored[0]
        if keys.ndim != 4 or values.ndim != 4 or keys.shape[:3] != (1, keys.shape[1], PROBE_LENGTH):
            continue
        if values.shape[:3] != keys.shape[:3]:
            continue
        ours = [c for c in calls if c[3] is cache]
        routed = len(ours) == 1 and ours[0][1] is keys and ours[0][2] is values
        return ProbedAttention(
            width=width, kv_heads=keys.shape[1], head_dim=keys.shape[3], value_dim=values.shape[3],
            dtype=keys.dtype, query_heads=ours[0][0].shape[1] if ours else None,
            defines_call=defines_call, routed=routed, sinks=any(c[4] is not None for c in ours),
        )
    return None
