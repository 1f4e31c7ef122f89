"""Find, at load, layers that attend to K/V another layer's cache returned (KV sharing).

Gemma 4's last ``num_kv_shared_layers`` layers have no cache entry: the model hands each the
K/V that an earlier layer's ``cache.update_and_fetch`` returned, and the layer attends to them
with ``cache=None``. Where a cache returns every position's K/V (the row cache, the pool
gather) that is exact as it is; where a cache returns only the step's new K/V because the
attention call reads the pool itself (the paged decode path), a shared layer's call reaches no
cache and would attend to the new token alone. One forward of two tokens on the model's own
fresh caches (built, not evaluated) shows such calls: an attention call whose keys are what
some cache returned, made with another cache or none.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import mlx.core as mx
import mlx.nn as nn

PROBE_TOKENS = 2


def _fetching(cache: object, fetched: dict[int, tuple[mx.array, object]]) -> None:
    """Make ``cache`` record (by array id, the array kept alive) which cache returned each key
    tensor it fetches."""
    update = cache.update_and_fetch

    def update_and_fetch(keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        out = update(keys, values)
        fetched[id(out[0])] = (out[0], cache)
        return out

    cache.update_and_fetch = update_and_fetch  # the instance only: the class stays as it is


@contextmanager
def _recorded(py_module: object, calls: list[tuple[object, object]]) -> Iterator[None]:
    """Record (keys, cache) of each ``py_module.scaled_dot_product_attention`` call while inside."""
    original = py_module.scaled_dot_product_attention

    def recording(queries, keys, values, *args, **kwargs):
        calls.append((keys, kwargs.get("cache", args[0] if args else None)))
        return original(queries, keys, values, *args, **kwargs)

    py_module.scaled_dot_product_attention = recording
    try:
        yield
    finally:
        py_module.scaled_dot_product_attention = original


def _attention_modules(layers: list[nn.Module]) -> list[object]:
    """The Python modules, of any submodule of ``layers``, that define the attention call the
    runtime routes (``attention_patch``)."""
    found: dict[str, object] = {}
    for layer in layers:
        for _, module in layer.named_modules():
            py_module = sys.modules.get(type(module).__module__)
            if py_module is not None and callable(getattr(py_module, "scaled_dot_product_attention", None)):
                found[py_module.__name__] = py_module
    return list(found.values())


def shares_kv(model: nn.Module, layers: list[nn.Module], flat: list, kv_entries: list[int],
              nest: Callable[[list], list]) -> bool:
    """Whether some attention call of ``model``'s forward attends to K/V that a cache returned
    without passing that cache. ``flat``: a fresh flat cache list (``model.make_cache()``,
    flattened; a plain ``KVCache`` per layer for models without one), ``kv_entries`` its KV
    entries, ``nest`` the layout's ``nest``. A forward that fails is left to the other probes."""
    fetched: dict[int, tuple[mx.array, object]] = {}
    for i in kv_entries:
        _fetching(flat[i], fetched)
    calls: list[tuple[object, object]] = []
    try:
        with ExitStack() as stack:
            for py_module in _attention_modules(layers):
                stack.enter_context(_recorded(py_module, calls))
            model(mx.zeros((1, PROBE_TOKENS), dtype=mx.int32), cache=nest(flat))
    except Exception:  # noqa: BLE001 - a model that cannot run so: the other probes say why
        return False
    for keys, cache in calls:
        source = fetched.get(id(keys))
        if source is not None and source[0] is keys and source[1] is not cache:
            return True
    return False
