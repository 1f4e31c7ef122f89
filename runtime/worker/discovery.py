"""Find the attention modules of an mlx-lm model and describe its cache layout."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

ATTENTION_ATTRS = ("self_attn", "attention", "attn", "mixer", "self_attention")


class UnsupportedModel(ValueError):
    """The model cannot be served correctly; the message says why."""


@dataclass(frozen=True)
class AttentionShape:
    """K/V geometry of one softmax-attention layer."""

    n_heads: int
    n_kv_heads: int
    head_dim: int


@dataclass(frozen=True)
class CacheLayout:
    """Which cache entries are attention (KV pool) and which carry auxiliary state.

    ``num_layers`` counts cache entries (one per layer for most models);
    ``kv_index[entry]`` is the entry's index into the KV pool, or -1;
    ``attn_attr[layer]`` is the attribute holding a layer's attention, or None;
    ``windows[entry]`` is how many of the latest positions a sliding-window layer attends to
    (mlx-lm's ``RotatingKVCache(max_size=window)``), or None for a full layer. The pool keeps
    every position of every layer; a windowed layer's masks hide the older ones.
    """

    num_layers: int
    attention_layers: tuple[int, ...]
    aux_layers: tuple[int, ...]
    kv_index: tuple[int, ...]
    attn_attr: tuple[str | None, ...]
    kv_shape: AttentionShape | None
    kv_dtype: mx.Dtype
    mask_rank: int = 4  # rank of the attention scores a decode mask is added to (``query_mask_rank``)
    windows: tuple[int | None, ...] = ()

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


def model_layers(model: nn.Module) -> list[nn.Module]:
    """The decoder layers of a model or of its language model."""
    for owner in (model, getattr(model, "language_model", None), getattr(model, "model", None)):
        if owner is None:
            continue
        layers = getattr(owner, "layers", None)
        if isinstance(layers, (list, tuple)) and layers:
            return list(layers)
    raise UnsupportedModel("model has no `layers` list; cannot find its decoder layers")


def _int_attr(module: nn.Module, *names: str) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def _out_features(proj: nn.Module) -> int:
    weight = proj["weight"] if isinstance(proj, dict) else proj.weight
    width = weight.shape[0]
    return width


def is_softmax_attention(module: nn.Module) -> bool:
    """True for q/k/v/o attention with RoPE, a scale and head counts (not a linear mixer)."""
    has_proj = all(hasattr(module, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))
    has_heads = _int_attr(module, "n_heads", "num_attention_heads", "num_heads") is not None
    has_scale = isinstance(getattr(module, "scale", None), float)
    has_rope = hasattr(module, "rope") or hasattr(module, "rotary_emb")
    return has_proj and has_heads and has_scale and has_rope


def attention_shape(module: nn.Module) -> AttentionShape:
    """Head counts from either spelling; head_dim from the module or the k projection."""
    n_heads = _int_attr(module, "n_heads", "num_attention_heads", "num_heads")
    n_kv = _int_attr(module, "n_kv_heads", "num_key_value_heads", "num_kv_heads") or n_heads
    head_dim = _int_attr(module, "head_dim")
    if head_dim is None:
        k_width = _out_features(module.k_proj)
        if hasattr(module.k_proj, "bits"):  # quantized: packed uint32 columns
            k_width = module.k_proj.weight.shape[0]
        head_dim = k_width // n_kv
    assert n_heads is not None
    return AttentionShape(n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim)


def kv_dtype(module: nn.Module, fallback: mx.Dtype) -> mx.Dtype:
    """A float dtype for K/V even when the projections are quantized."""
    proj = module.k_proj
    for name in ("weight", "scales"):
        arr = getattr(proj, name, None)
        if isinstance(arr, mx.array) and mx.issubdtype(arr.dtype, mx.floating):
            return arr.dtype
    return fallback


def _attend(module: nn.Module, x: mx.array, mask: mx.array | None) -> mx.array | None:
    """``module``'s output on ``x`` with ``mask`` and no cache, or None where it fails."""
    try:
        out = module(x, mask=mask, cache=None)
        mx.eval(out)
    except Exception:  # a module that cannot run alone, or a mask that does not broadcast
        return None
    return out


def query_mask_rank(module: nn.Module, shape: AttentionShape, dtype: mx.Dtype) -> int | None:
    """The rank a per-row decode mask must have to broadcast against ``module``'s scores:
    4 for (B, heads, L, T), 5 for queries grouped by hand as (B, kv_heads, n_rep, L, T)
    (gemma2). None when the module cannot be run alone on a plain input (left as 4).

    Probed once at load with an all-true mask over a batch larger than every head count, so
    a mask of the wrong rank cannot broadcast silently (batch against a head axis): it fails
    or changes the output.
    """
    batch = shape.n_heads + 1
    width = _out_features(module.o_proj)
    x = mx.random.normal((batch, 2, width), key=mx.random.key(0)).astype(dtype)  # fixed key: RNG untouched
    reference = _attend(module, x, None)
    if reference is None:
        return None
    for rank in (4, 5):
        out = _attend(module, x, mx.ones((batch,) + (1,) * (rank - 2) + (2,), dtype=mx.bool_))
        # An all-true mask changes nothing but rounding (masked kernels may differ from unmasked
        # ones in bf16); a mask of the wrong rank fails, or changes the shape or the values.
        if out is not None and out.shape == reference.shape and mx.allclose(out, reference, rtol=1e-2, atol=1e-2).item():
            return rank
    raise UnsupportedModel(
        f"{type(module).__name__} attention accepts no per-row decode mask of rank 4 or 5; "
        "batched decode would be wrong, so this model is not served")


def find_attention(layer: nn.Module) -> str | None:
    """The attribute name of a layer's softmax attention, or None."""
    for name in ATTENTION_ATTRS:
        module = getattr(layer, name, None)
        if module is not None and is_softmax_attention(module):
            return name
    return None


AUX_CACHE_KINDS = ("ArraysCache", "MambaCache")
KV_CACHE_KINDS = ("KVCache", "RotatingKVCache")


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


def discover(model: nn.Module) -> CacheLayout:
    """Build the cache layout over the model's cache entries; refuse what cannot be served.

    Entries come from ``model.make_cache()`` when the model has it (hybrids, and models
    whose cache list skips MLP-only blocks), else one KV entry per layer.
    """
    layers = model_layers(model)
    attn_attr = [find_attention(layer) for layer in layers]
    caches = model.make_cache() if hasattr(model, "make_cache") else None
    kinds = [type(c).__name__ for c in caches] if caches is not None else ["KVCache"] * len(layers)
    windows = tuple(cache_window(c) for c in caches) if caches is not None else (None,) * len(layers)
    if len({w for w in windows if w is not None}) > 1:
        # mlx-lm models build one sliding-window mask for all their local layers.
        raise UnsupportedModel(f"sliding-window layers have different windows ({sorted({w for w in windows if w})})")
    per_layer = len(kinds) == len(layers)
    attention_modules = [getattr(layer, name) for layer, name in zip(layers, attn_attr) if name is not None]
    attention, aux, kv_index = [], [], []
    shape: AttentionShape | None = None
    dtype = mx.float32
    ranks: dict[type, int | None] = {}  # per attention class: one decode mask serves every layer
    for i, kind in enumerate(kinds):
        if kind in KV_CACHE_KINDS:
            if per_layer:
                name = attn_attr[i]
                module = getattr(layers[i], name) if name is not None else None
            else:
                j = len(attention)
                module = attention_modules[j] if j < len(attention_modules) else None
            if module is None:
                raise UnsupportedModel(f"cache entry {i} is a KV cache but no attention module the runtime recognises")
            this = attention_shape(module)
            if shape is not None and this != shape:
                raise UnsupportedModel(f"attention layers have different K/V shapes ({shape} vs {this})")
            shape = this
            dtype = kv_dtype(module, dtype)
            if type(module) not in ranks:
                ranks[type(module)] = query_mask_rank(module, this, dtype)
            kv_index.append(len(attention))
            attention.append(i)
        elif kind in AUX_CACHE_KINDS:
            kv_index.append(-1)
            aux.append(i)
        else:
            raise UnsupportedModel(
                f"cache entry {i} is a {kind} (chunked or quantized cache), which this runtime does not serve"
            )
    known = {r for r in ranks.values() if r is not None}
    if len(known) > 1:
        raise UnsupportedModel(f"attention layers group their queries differently (score ranks {sorted(known)})")
    return CacheLayout(
        num_layers=len(kinds),
        attention_layers=tuple(attention),
        aux_layers=tuple(aux),
        kv_index=tuple(kv_index),
        attn_attr=tuple(attn_attr),
        kv_shape=shape,
        kv_dtype=dtype,
        mask_rank=known.pop() if known else 4,
        windows=windows,
    )
