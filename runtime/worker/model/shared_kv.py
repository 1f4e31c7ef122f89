"""Find, at load, layers that attend to K/V another layer's cache returned (KV sharing).

Gemma 4's last ``num_kv_shared_layers`` layers have no cache entry: the model hands each the
K/V that an earlier layer's ``cache.update_and_fetch`` returned, and the layer attends to them
with ``cache=None``. Gemma 3n's are handed the earlier layer's cache object and read its K/V
back with ``cache.keys_and_values()``. Where a cache returns every position's K/V (the row
cache, the pool gather) both are exact as they are (the runtime's ``keys_and_values()`` is what
this forward's ``update_and_fetch`` returned); where a cache returns only the step's new K/V
because the attention call reads the pool itself (the paged decode path), a shared layer would
attend to the new token alone. One forward of two tokens on the model's own fresh caches
(built, not evaluated) shows either: an attention call whose keys are what some cache returned,
made with another cache or none, or a ``keys_and_values()`` call from outside the cache's own
``update_and_fetch``.
"""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager

import mlx.core as mx
import mlx.nn as nn

PROBE_TOKENS = 2


def _fetching(cache: object, fetched: dict[int, tuple[mx.array, object]], read_back: list[object]) -> None:
    """Make ``cache`` record (by array id, the array kept alive) which cache returned each key
    tensor it fetches, and append itself to ``read_back`` when a caller other than its own
    ``update_and_fetch`` (mlx-lm's KVCache returns through it) calls ``keys_and_values()``."""
    update, read = cache.update_and_fetch, getattr(cache, "keys_and_values", None)
    updating = [False]

    def update_and_fetch(keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        updating[0] = True
        try:
            out = update(keys, values)
        finally:
            updating[0] = False
        fetched[id(out[0])] = (out[0], cache)
        return out

    def keys_and_values() -> tuple[mx.array, mx.array]:
        if not updating[0]:
            read_back.append(cache)
        return read()

    cache.update_and_fetch = update_and_fetch  # the instance only: the class stays as it is
    if read is not None:
        cache.keys_and_values = keys_and_values


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
    without passing that cache, or some layer reads a cache's K/V back (``keys_and_values()``).
    ``flat``: a fresh flat cache list (``model.make_cache()``, flattened; a plain ``KVCache``
    per layer for models without one), ``kv_entries`` its KV entries, ``nest`` the layout's
    ``nest``. A forward that fails is left to the other probes."""
    fetched: dict[int, tuple[mx.array, object]] = {}
    read_back: list[object] = []
    for i in kv_entries:
        _fetching(flat[i], fetched, read_back)
    calls: list[tuple[object, object]] = []
    try:
        with ExitStack() as stack:
            for py_module in _attention_modules(layers):
                stack.enter_context(_recorded(py_module, calls))
            model(mx.zeros((1, PROBE_TOKENS), dtype=mx.int32), cache=nest(flat))
    except Exception:  # noqa: BLE001 - a model that cannot run so: the other probes say why
        return False
    if read_back:
        return True
    for keys, cache in calls:
        source = fetched.get(id(keys))
        if source is not None and source[0] is keys and source[1] is not cache:
            return True
    return False
