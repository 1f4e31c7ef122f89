"""Which leading decoder layers a prefill warm-up forward may stop after.

A warm-up forward only has to make MLX build a shape's kernels and plans, and a layer's are the
same at every depth where the layers are the same. So where every layer is alike the warm-up
runs through the first one; where a hybrid repeats a pattern of layer kinds (Qwen3-Next: three
delta-net layers, then one attention layer), through the shortest run of leading layers that
holds one of each kind. The other layers' compute was most of the warm-up's time (181 shapes of
an 8B through every layer: 20 s on an H100).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import mlx.nn as nn

from runtime.worker.model.discovery import layers_owner


def alike_layers(layout) -> bool:
    """Every layer full attention of one K/V shape: no window, no recurrent state, no sharing."""
    return (len(layout.attention_layers) == layout.num_layers and not layout.has_aux and not layout.shares_kv
            and len(set(layout.kv_shapes)) == 1 and all(w is None for w in layout.windows))


def _kind(layer: nn.Module, index: int, layout) -> tuple:
    """What a layer builds kernels for: its module classes and whether it is attention or state."""
    parts = tuple(sorted((name, type(child).__name__) for name, child in layer.children().items()
                         if isinstance(child, nn.Module)))
    return type(layer).__name__, parts, index in layout.attention_layers, index in layout.aux_layers


def leading_layers(layers: list[nn.Module], layout) -> int:
    """How many leading layers hold one of each kind of layer: 1 where all are alike; for a
    hybrid of one entry a layer, one K/V shape and no window, the shortest such run; otherwise
    all of them (per-layer shapes or windows are not told apart by module classes)."""
    if alike_layers(layout):
        return 1
    one_entry_a_layer = layout.num_layers == len(layers)  # (a CacheList layer has several entries)
    if not (layout.has_aux and one_entry_a_layer and not layout.shares_kv and len(set(layout.kv_shapes)) <= 1
            and all(w is None for w in layout.windows)):
        return len(layers)
    first: dict[tuple, int] = {}
    for i, layer in enumerate(layers):
        first.setdefault(_kind(layer, i, layout), i)
    return max(first.values()) + 1


@contextlib.contextmanager
def leading_layers_only(model: nn.Module, layout) -> Iterator[int]:
    """The model's forward through its ``leading_layers`` only; yields how many (0: all of them,
    unchanged). The caches handed to the forward stay whole: the model pairs layers with their
    entries in order, so the leading ones meet their own."""
    owner = layers_owner(model)
    # the list must be the owner's own entry (not a property reading another module's) to swap it
    layers = dict.get(owner, "layers") if owner is not None else None
    keep = leading_layers(layers, layout) if isinstance(layers, list) and len(layers) >= 2 else 0
    if not keep or keep >= len(layers):
        yield 0
        return
    owner["layers"] = layers[:keep]
    try:
        yield keep
    finally:
        owner["layers"] = layers
