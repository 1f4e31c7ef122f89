"""Find the attention modules of an mlx-lm model and describe its cache layout."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
from mlx_lm.models.cache import KVCache

from runtime.worker.model.attention_probe import (
    ProbedAttention,
    probe_attention,
    takes_cache,
)
from runtime.worker.model.cache_entries import EntryGroups, NestedCacheError
from runtime.worker.model.forward_probe import ForwardRefusal, check_forward
from runtime.worker.model.mask_probe import MaskRefusal, behaviour_key, query_mask_rank
from runtime.worker.model.shared_kv import shares_kv


class UnsupportedModel(ValueError):
    """The model cannot be served correctly; the message says why."""


@dataclass(frozen=True)
class AttentionShape:
    """K/V geometry of one softmax-attention layer: ``head_dim`` is the width of a stored key,
    ``value_dim`` that of a stored value where it differs (latent attention: DeepSeek-V2 caches
    24-wide keys and 16-wide values per head; DeepSeek-V3 a latent as keys and a rotary key as
    values, one head), None where they are equal."""

    n_heads: int
    n_kv_heads: int
    head_dim: int
    value_dim: int | None = None

    @property
    def value_width(self) -> int:
        """The width of a stored value."""
        return self.head_dim if self.value_dim is None else self.value_dim

    @property
    def same_widths(self) -> bool:
        """Keys and values have one width (what the paged decode kernel reads)."""
        return self.value_width == self.head_dim


@dataclass(frozen=True)
class CacheLayout:
    """Which cache entries are attention (KV pool) and which carry auxiliary state.

    Entries are flat: a model cache entry that is a ``CacheList`` (Falcon-H1's Mamba state and
    KV cache per layer) counts as one entry per part, ``groups`` records how to nest them back
    (``flatten``/``nest``). ``num_layers`` counts flat entries (one per layer for most models);
    ``kv_index[entry]`` is the entry's index into the KV pool, or -1;
    ``attn_attr[layer]`` is the attribute (path) holding a layer's attention, or None;
    ``windows[entry]`` is how many of the latest positions a sliding-window layer attends to
    (mlx-lm's ``RotatingKVCache(max_size=window)``), or None for a full layer. The pool keeps
    every position of every layer; a windowed layer's masks hide the older ones.
    ``kv_shapes[k]`` is KV-pool layer k's geometry: layers may differ (Gemma 4's global layers
    store wider heads than its sliding ones, OpenELM's head counts grow with depth); ``kv_shape``
    is the one shape of a model whose layers all have it, what the paths that need one read.
    """

    num_layers: int
    attention_layers: tuple[int, ...]
    aux_layers: tuple[int, ...]
    kv_index: tuple[int, ...]
    attn_attr: tuple[str | None, ...]
    kv_shapes: tuple[AttentionShape, ...]
    kv_dtype: mx.Dtype
    mask_rank: int = 4  # rank of the attention scores a decode mask is added to (``query_mask_rank``)
    windows: tuple[int | None, ...] = ()
    # Every attention module attends through its Python module's scaled_dot_product_attention
    # to the K/V its cache returned, so a paged decode may answer that call from the pool.
    # Modules that attend by hand, or to tensors made from what the cache returned (DeepSeek-V3
    # expands its latent in prefill and adds rotary scores as a float mask), are served on the
    # paths whose cache returns every position's K/V (``AttentionPaths``).
    routed: bool = True
    # Some attention call passes attention-sink logits (gpt-oss): the paged kernel's sink variant.
    sinks: bool = False
    # Some layer attends to K/V another layer's cache returned, with no cache entry of its own
    # (Gemma 4's KV-shared layers, handed them through the forward; Gemma 3n's, reading them back
    # through the other layer's cache with ``keys_and_values()``): only paths whose cache returns
    # every position's K/V serve it.
    shares_kv: bool = False
    # One decode token's forward traces under mx.compile (``forward_probe``). False for a model
    # that reads arrays back mid-forward (DBRX's ``.tolist()`` expert choice): the engine then
    # compiles none of its forward, every step runs eager.
    traceable: bool = True
    groups: EntryGroups = EntryGroups()

    def flatten(self, caches: list) -> list:
        """The flat entries of a model cache list (``model.make_cache()``)."""
        return self.groups.flatten(caches)

    def nest(self, flat: list) -> list:
        """The model's cache list from one cache object per flat entry."""
        return self.groups.nest(flat)

    @property
    def kv_shape(self) -> AttentionShape | None:
        """The one shape of every attention layer, or None (no attention, or layers that differ)."""
        shapes = set(self.kv_shapes)
        return self.kv_shapes[0] if len(shapes) == 1 else None

    @property
    def has_aux(self) -> bool:
        return bool(self.aux_layers)

    @property
    def windowed(self) -> bool:
        """Some layer attends to a sliding window only."""
        return any(w is not None for w in self.windows)

    def window(self, entry: int) -> int | None:
        """The sliding window of cache entry ``entry``, or None."""
        return self.windows[entry] if self.windows else None


def layers_owner(model: nn.Module) -> nn.Module | None:
    """The module holding the decoder layer list (``model.model`` for Llama), or None."""
    for owner in (getattr(model, "model", None), getattr(getattr(model, "language_model", None), "model", None), model):
        if isinstance(owner, nn.Module) and isinstance(getattr(owner, "layers", None), list):
            return owner
    return None


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a model or of its language model."""
    for owner in (model, getattr(model, "language_model", None), getattr(model, "model", None)):
        if owner is None:
            continue
        layers = getattr(owner, "layers", None)
        if isinstance(layers, (list, tuple)) and layers:
            return list(layers)
    raise UnsupportedModel("model has no `layers` list; cannot find its decoder layers")


# Query head counts in the spellings mlx-lm's modules use (PLaMo 2's ``q_num_heads``).
_QUERY_HEAD_ATTRS = ("n_heads", "num_attention_heads", "num_heads", "q_num_heads")


def _int_attr(module: nn.Module, *names: str) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def attention_shape(module: nn.Module) -> AttentionShape:
    """Head counts from the module's attributes, in either spelling; head_dim from the module or
    the k projection (a fallback: ``discover`` takes K/V geometry from the probe)."""
    n_heads = _int_attr(module, *_QUERY_HEAD_ATTRS)
    n_kv = _int_attr(module, "n_kv_heads", "num_key_value_heads", "num_kv_heads") or n_heads
    head_dim = _int_attr(module, "head_dim")
    if head_dim is None:
        k_width = module.k_proj.weight.shape[0]  # quantized too: one packed row per output
        head_dim = k_width // n_kv
    assert n_heads is not None
    return AttentionShape(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)


@dataclass(frozen=True)
class LayerAttention:
    """A layer's attention module: the attribute holding it and what its probe showed."""

    attr: str
    module: nn.Module
    probe: ProbedAttention

    @property
    def shape(self) -> AttentionShape:
        """K/V geometry from the probe; the query head count from the attention call, or, for a
        module that attends by hand, from its attributes."""
        probe, name = self.probe, type(self.module).__name__
        n_heads = probe.query_heads or _int_attr(self.module, *_QUERY_HEAD_ATTRS)
        if n_heads is None or n_heads % probe.kv_heads:
            raise UnsupportedModel(f"{name}: cannot tell its query head count ({n_heads!r} for "
                                   f"{probe.kv_heads} KV heads)")
        value_dim = probe.value_dim if probe.value_dim != probe.head_dim else None
        return AttentionShape(n_heads=n_heads, n_kv_heads=probe.kv_heads, head_dim=probe.head_dim, value_dim=value_dim)


def _submodules(layer: nn.Module) -> list[tuple[str, nn.Module]]:
    """``layer``'s direct submodules, and those of a direct submodule that is a plain holder
    (not callable: EXAONE's ``attn`` holds ``attention``), under dotted paths."""
    found = []
    for name, child in layer.items():
        if isinstance(child, nn.Module):
            found.append((name, child))
            if not callable(child):
                found += [(f"{name}.{sub}", m) for sub, m in child.items() if isinstance(m, nn.Module)]
    return found


def submodule(layer: nn.Module, path: str) -> nn.Module:
    """The module at a (dotted) ``attn_attr`` path of ``layer``."""
    for name in path.split("."):
        layer = getattr(layer, name)
    return layer


def layer_attention(layer: nn.Module) -> LayerAttention | None:
    """The one submodule of ``layer`` (direct, or in a plain holder) that stores K/V through its
    cache, or None: any attribute name (``self_attn``, ``attention``, ``mixer``...) and any
    projections."""
    found = [(name, child, p) for name, child in _submodules(layer) if (p := probe_attention(child)) is not None]
    if len(found) > 1:
        raise UnsupportedModel(f"{type(layer).__name__} has several modules storing K/V "
                               f"({', '.join(n for n, _, _ in found)}); one KV cache per layer is served")
    return LayerAttention(*found[0]) if found else None


def shared_kv_attention(layer: nn.Module, probed: list[LayerAttention]) -> LayerAttention | None:
    """A layer's attention that reads K/V projected by an earlier layer (cross-layer attention,
    Hunyuan's ``use_cla``): it has no K/V projections of its own, so it cannot be probed alone.
    It is the direct submodule of the class of an attention probed in another layer (that
    layer's geometry, from the same arguments), found only where the layer's cache entry is a
    KV cache."""
    classes = {type(found.module): found for found in probed}
    shared = [(name, child) for name, child in layer.items()
              if isinstance(child, nn.Module) and type(child) in classes and takes_cache(child)]
    if len(shared) != 1:
        return None
    name, child = shared[0]
    return LayerAttention(name, child, classes[type(child)].probe)


def find_attention(layer: nn.Module) -> str | None:
    """The attribute name of a layer's softmax attention, or None."""
    found = layer_attention(layer)
    return found.attr if found is not None else None


def is_softmax_attention(module: nn.Module) -> bool:
    """True for a module that stores K/V through a KV cache and attends to them (the probe);
    a linear-attention or state-space mixer is not one, whatever projections it has."""
    return probe_attention(module) is not None


AUX_CACHE_KINDS = ("ArraysCache", "MambaCache")
KV_CACHE_KINDS = ("KVCache", "RotatingKVCache")
# Cache kinds refused at load, and why (named in the message).
REFUSED_CACHE_KINDS = {
    "CacheList": "a CacheList inside a CacheList: lists nested more than one level are not served",
    "ChunkedKVCache": "a ChunkedKVCache: chunked attention is not served",
    "QuantizedKVCache": "a QuantizedKVCache: quantized K/V are not served",
}


def _check_kind(entry: int, kind: str) -> None:
    if kind not in KV_CACHE_KINDS and kind not in AUX_CACHE_KINDS:
        why = REFUSED_CACHE_KINDS.get(kind, f"a {kind}, a cache kind this runtime does not serve")
        raise UnsupportedModel(f"cache entry {entry} is {why}")


def cache_window(cache: object) -> int | None:
    """The window of a sliding-window cache entry (None for a full one); refuses what
    windowing alone cannot reproduce."""
    if type(cache).__name__ != "RotatingKVCache":
        return None
    keep, window = getattr(cache, "keep", 0), getattr(cache, "max_size", None)
    if keep:
        # Decode would keep the first ``keep`` positions too, while mlx-lm's prefill mask does not.
        raise UnsupportedModel(f"RotatingKVCache with keep={keep} (attention-sink positions) is not served")
    if not isinstance(window, int) or window < 1:
        raise UnsupportedModel(f"RotatingKVCache with max_size={window!r} is not served")
    return window


def _attention_owners(layers: list[nn.Module], kinds: list[str], groups: EntryGroups
                      ) -> dict[int, tuple[int, LayerAttention]]:
    """Each flat KV cache entry's (layer index, attention module). One model entry per layer:
    model entry j (a cache, or a CacheList whose one KV part is the entry) is layer j's; a
    cache list that skips layers (MLP-only blocks): the k-th KV entry is the k-th layer with
    attention."""
    kv_entries = [i for i, kind in enumerate(kinds) if kind in KV_CACHE_KINDS]
    model_entry = groups.owners(len(kinds))
    if len(set(model_entry)) == len(layers):
        owners = {}
        for i in kv_entries:
            j = model_entry[i]
            if sum(model_entry[k] == j for k in kv_entries) > 1:
                raise UnsupportedModel(f"cache entry {j} is a CacheList of several KV caches (one layer storing "
                                       "K/V twice, e.g. an indexer's keys beside its attention's); not served")
            found = layer_attention(layers[j])
            if found is None:
                found = shared_kv_attention(layers[j], [f for _, f in owners.values()])
            if found is None:
                raise UnsupportedModel(
                    f"cache entry {j} is a KV cache, but no module of layer {j} stores K/V through it "
                    "(called as module(x, mask=..., cache=...), cache.update_and_fetch then attention)")
            owners[i] = (j, found)
        return owners
    if groups.nested:
        raise UnsupportedModel(f"{len(set(model_entry))} cache entries (some a CacheList) for {len(layers)} "
                               "layers; cannot tell which layer owns which entry")
    found_all = [(j, f) for j, layer in enumerate(layers) if (f := layer_attention(layer)) is not None]
    if found_all and len(kv_entries) == len(kinds) and len(kv_entries) % len(found_all) == 0 \
            and len(found_all) == len(layers):
        # A stack run several times on shared weights (Nanbeige's num_loops), one KV entry per
        # layer and pass: entry i is layer i % layers' in pass i // layers.
        return {i: found_all[i % len(found_all)] for i in kv_entries}
    if len(found_all) != len(kv_entries):
        raise UnsupportedModel(f"{len(kv_entries)} KV cache entries for {len(found_all)} layers whose module "
                               "stores K/V; cannot tell which layer owns which entry")
    return dict(zip(kv_entries, found_all))


def discover(model: nn.Module) -> CacheLayout:
    """Build the cache layout over the model's cache entries; refuse what cannot be served.

    Entries come from ``model.make_cache()`` when the model has it (hybrids, and models
    whose cache list skips MLP-only blocks), else one KV entry per layer. A KV entry's
    attention is the module that stores K/V through it (``attention_probe``); one forward of
    the whole model on stand-in caches checks what only the model's own call shows
    (``forward_probe``), another on its own fresh caches finds layers attending to K/V another
    layer's cache returned (``shared_kv``). Attention layers may differ in shape (each is
    recorded in ``kv_shapes``), not in K/V dtype.
    """
    layers = model_layers(model)
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    try:
        groups = EntryGroups.of(caches) if caches is not None else EntryGroups()
    except NestedCacheError as e:
        raise UnsupportedModel(str(e)) from None
    caches = groups.flatten(caches) if caches is not None else None
    kinds = [type(c).__name__ for c in caches] if caches is not None else ["KVCache"] * len(layers)
    for i, kind in enumerate(kinds):
        _check_kind(i, kind)
    windows = tuple(cache_window(c) for c in caches) if caches is not None else (None,) * len(layers)
    if len({w for w in windows if w is not None}) > 1:
        # mlx-lm models build one sliding-window mask for all their local layers.
        raise UnsupportedModel(f"sliding-window layers have different windows ({sorted({w for w in windows if w})})")
    owners = _attention_owners(layers, kinds, groups)
    attn_attr: list[str | None] = [None] * len(layers)
    for j, found in owners.values():
        attn_attr[j] = found.attr
    attention, aux, kv_index = [], [], []
    shapes: list[AttentionShape] = []
    dtype: mx.Dtype | None = None
    ranks: dict[tuple, int | None] = {}  # one decode mask must serve every layer: probed per behaviour_key
    for i, kind in enumerate(kinds):
        if kind in AUX_CACHE_KINDS:
            kv_index.append(-1)
            aux.append(i)
            continue
        found = owners[i][1]
        this = found.shape  # layers may differ: the pool stores each at its own shape
        if dtype is not None and found.probe.dtype != dtype:
            raise UnsupportedModel(f"attention layers store K/V of different dtypes ({dtype} vs {found.probe.dtype})")
        dtype = found.probe.dtype
        shapes.append(this)
        key = behaviour_key(found.module)  # also once for a module shared by layers (looped models)
        if key not in ranks:
            try:
                ranks[key] = query_mask_rank(found.module, this.n_heads, dtype, found.probe.width)
            except MaskRefusal as e:
                raise UnsupportedModel(str(e)) from None
        kv_index.append(len(attention))
        attention.append(i)
    known = {r for r in ranks.values() if r is not None}
    if len(known) > 1:
        raise UnsupportedModel(f"attention layers group their queries differently (score ranks {sorted(known)})")
    try:
        traceable = check_forward(model, caches if caches is not None else [None] * len(kinds), attention,
                                  windows, groups.nest)
    except ForwardRefusal as e:
        raise UnsupportedModel(str(e)) from None
    fresh = groups.flatten(model.make_cache()) if caches is not None else [KVCache() for _ in kinds]
    return CacheLayout(
        num_layers=len(kinds),
        attention_layers=tuple(attention),
        aux_layers=tuple(aux),
        kv_index=tuple(kv_index),
        attn_attr=tuple(attn_attr),
        kv_shapes=tuple(shapes),
        kv_dtype=dtype or mx.float32,
        mask_rank=known.pop() if known else 4,
        windows=windows,
        routed=all(owners[i][1].probe.routed for i in attention),
        sinks=any(owners[i][1].probe.sinks for i in attention),
        shares_kv=bool(attention) and shares_kv(model, layers, fresh, attention, groups.nest),
        traceable=traceable,
        groups=groups,
    )
