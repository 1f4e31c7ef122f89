"""Forwards of the whole model at load (built or traced, never evaluated), on KV caches that
offer only what the runtime's stand-ins offer, to refuse what the per-module attention probe
cannot see.

Some things only show in the model's own forward: a layer that needs a cache method the
runtime's caches lack, and a model that asks a sliding-window layer's mask for a wider
window than its ``RotatingKVCache`` keeps (PLaMo 3's prefill mask spans window + 1, its decode
sees the cache's window): the runtime's caches window every mask by the cache, so mlx-lm's
prefill and its decode cannot both be matched. The forward builds the graph of two tokens and
evaluates nothing; then one decode token's forward is traced under ``mx.compile``, as the
runtime's compiled decode step traces it: a model that reads arrays back to the host inside its
forward (DBRX picks each token's experts through ``.tolist()``) cannot be traced so, and is
served with every compiled path off (``CacheLayout.traceable``). A model
with only KV caches also builds one decode step of two rows at different positions, as batched
decode hands it one offset per row: it must not fail there, nor rotate by one position for both
rows (AFM's KV-reuse layers take their queries' position from the length of the K/V they read
back, ``keys.shape[2] - L``, where batched decode attends to K/V padded to a common length).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.base import create_causal_mask

PROBE_TOKENS = 2


class _KVStandIn:
    """A KV cache with the interface the worker's stand-ins (``paths/pool_cache.py``) offer:
    ``offset``, ``update_and_fetch``, ``keys_and_values`` (what ``update_and_fetch`` returned),
    ``make_mask``, ``state``, ``is_trimmable``, ``empty``. Records the mask windows asked of it."""

    def __init__(self, offset: int | mx.array = 0) -> None:
        self.offset = offset
        self.asked_windows: list[int] = []
        self.fetched: tuple[mx.array, mx.array] | None = None

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.fetched = (keys, values)
        return keys, values

    def keys_and_values(self) -> tuple[mx.array, mx.array]:
        if self.fetched is None:
            raise ForwardRefusal("a layer reads K/V back through `keys_and_values()` before any layer stored them "
                                 "this forward; the runtime's caches return only what this forward fetched, so "
                                 "this model is not served")
        return self.fetched

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array | str | None:
        if window_size is not None:
            self.asked_windows.append(window_size)
        if window_size is not None or return_array:
            return create_causal_mask(n, 0, window_size=window_size)
        return "causal" if n > 1 else None

    @property
    def state(self) -> list:
        return []

    def is_trimmable(self) -> bool:
        return False

    def empty(self) -> bool:
        return False

    def __getattr__(self, name: str):
        raise AttributeError(name, name=name, obj=self)


class ForwardRefusal(ValueError):
    """What the forward showed that cannot be served; the message says why."""


@contextmanager
def _rope_offsets(offsets: list[object]) -> Iterator[None]:
    """Record the ``offset`` of every ``mx.fast.rope`` call while inside (``nn.RoPE`` and
    mlx-lm's scaled RoPE variants call it)."""
    original = mx.fast.rope

    def rope(*args, **kwargs):
        offsets.append(kwargs.get("offset"))  # keyword-only in mx.fast.rope
        return original(*args, **kwargs)

    mx.fast.rope = rope
    try:
        yield
    finally:
        mx.fast.rope = original


def _check_row_positions(model: nn.Module, entries: int, nest: Callable[[list], list]) -> None:
    """Build one decode step of two rows at positions 2 and 3 (``offset`` a (2,) array, as
    batched decode passes it to a model with only KV caches); a model that reads the offset as
    one host number (GPTBigCode's ``np.arange``, dynamic-NTK RoPE's ``max``) fails there, and one
    that rotates by a host number (AFM's KV-reuse layers: ``keys.shape[2] - L``) rotates both
    rows by one position."""
    offset = mx.array([PROBE_TOKENS, PROBE_TOKENS + 1])
    offsets: list[object] = []
    try:
        with _rope_offsets(offsets):
            model(mx.zeros((2, 1), dtype=mx.int32), cache=nest([_KVStandIn(offset) for _ in range(entries)]))
    except Exception as e:  # noqa: BLE001 - whatever it raises, it cannot decode rows together
        reason = str(e).splitlines()[0] if str(e) else ""
        raise ForwardRefusal(
            f"its forward fails on rows at different positions ({type(e).__name__}: {reason}): it reads the "
            "cache offset as one number, while batched decode gives one per row; not served") from None
    if any(not isinstance(o, mx.array) for o in offsets):
        raise ForwardRefusal(
            "its forward gives RoPE one position for rows at different positions (a host number, not the "
            "cache's per-row offsets: e.g. the length of the K/V a layer reads back, which batched decode pads "
            "to a common length); not served")


def check_forward(model: nn.Module, caches: list, kv_entries: list[int], windows: tuple[int | None, ...],
                  nest: Callable[[list], list]) -> bool:
    """Run ``model`` on two tokens with a ``_KVStandIn`` for each flat KV entry (``caches``: the
    model's fresh flat cache list, ``nest`` its ``CacheLayout.nest``); raise ``ForwardRefusal``
    where a layer needs a cache method the runtime lacks, a mask is wider than its cache's
    window or rows at different positions cannot decode together. A forward that fails otherwise
    (a model that cannot run so) is left to the probes. Returns whether one decode token's
    forward traces under ``mx.compile`` (True where the forward could not run here)."""
    stand_ins = {i: _KVStandIn() for i in kv_entries}
    flat = [stand_ins.get(i, cache) for i, cache in enumerate(caches)]
    try:
        model(mx.zeros((1, PROBE_TOKENS), dtype=mx.int32), cache=nest(flat))
    except AttributeError as e:
        if isinstance(getattr(e, "obj", None), _KVStandIn):
            raise ForwardRefusal(
                f"a layer reads `{e.name}` from its KV cache; the runtime's caches do not offer it, so this "
                "model is not served") from None
        return True
    except ForwardRefusal:
        raise
    except Exception:  # noqa: BLE001 - a model that cannot run on two zero tokens alone
        return True
    if len(stand_ins) == len(caches):
        _check_row_positions(model, len(caches), nest)
    for i, stand_in in stand_ins.items():
        window = windows[i] if windows else None
        wider = [w for w in stand_in.asked_windows if window is not None and w > window]
        if wider:
            raise ForwardRefusal(
                f"its sliding-window mask spans {wider[0]} positions in prefill, but its cache keeps {window} "
                "(mlx-lm's prefill and decode attend to different windows); not served")
    return traces(model, [_KVStandIn() if i in stand_ins else cache for i, cache in enumerate(flat)], nest)


def traces(model: nn.Module, flat: list, nest: Callable[[list], list]) -> bool:
    """Trace (not run) one decode token's forward under ``mx.compile``: False where the plain
    forward runs but the traced one fails (it evaluates arrays mid-forward, e.g. ``.tolist()`` to
    pick experts), so the model decodes uncompiled."""
    def step(tokens: mx.array) -> mx.array:
        return model(tokens, cache=nest(flat))

    try:
        mx.compile(step)(mx.zeros((1, 1), dtype=mx.int32))
    except Exception:  # noqa: BLE001 - whatever stops the trace keeps the forward uncompiled
        return False
    return True
