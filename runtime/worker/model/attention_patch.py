"""Route mlx-lm's attention call to the pool when a layer's cache is a paged decode view.

mlx-lm's attention modules call a module-level ``scaled_dot_product_attention(queries,
keys, values, cache=..., scale=..., mask=...)``. Replacing that name in each attention
module's own Python module with a dispatcher lets a ``PoolLayerCache`` answer decode
attention straight from the KV pool, while every other caller (mlx-lm's own caches, the
bench's reference runs) reaches the original function unchanged. Installing is idempotent.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

import mlx.nn as nn

from runtime.worker.model.discovery import model_layers, submodule

_MARK = "_runtime_dispatch_original"


def _dispatcher(original: Callable) -> Callable:
    def scaled_dot_product_attention(queries, keys, values, cache, scale, mask, sinks=None):
        attend = getattr(cache, "paged_attend", None)
        if attend is not None and cache.paged:
            return attend(queries, scale, sinks)
        if getattr(cache, "attends_decode", False) and sinks is None and queries.shape[2] == 1:
            return cache.decode_attend(queries, keys, values, scale, mask)
        return original(queries, keys, values, cache=cache, scale=scale, mask=mask, sinks=sinks)

    setattr(scaled_dot_product_attention, _MARK, original)
    return scaled_dot_product_attention


def install(model: nn.Module, attn_attr: tuple[str | None, ...]) -> bool:
    """Patch the attention call of every attention layer's module; True if all are covered.

    False means some attention module's Python module has no module-level
    ``scaled_dot_product_attention``: the worker then keeps gathering K/V for it. Discovery
    refuses a module whose Python module has one but attends another way
    (``attention_probe``), so True means every attention call reaches the dispatcher.
    """
    layers = model_layers(model)
    modules = []
    for layer, name in zip(layers, attn_attr):
        if name is None:
            continue
        module = sys.modules.get(type(submodule(layer, name)).__module__)
        if module is None or not callable(getattr(module, "scaled_dot_product_attention", None)):
            return False
        modules.append(module)
    for module in modules:
        current = module.scaled_dot_product_attention
        if not hasattr(current, _MARK):
            module.scaled_dot_product_attention = _dispatcher(current)
    return bool(modules)


def is_installed(module) -> bool:
    """Whether ``module``'s attention call already goes through the dispatcher."""
    return hasattr(getattr(module, "scaled_dot_product_attention", None), _MARK)
