"""The decode-mask probes of model discovery: which rank a per-row decode mask must have for an
attention module, and whether its mask hides what it masks. Each probe runs the module on a
small batch (a forward each, evaluated), so ``discover`` probes once per ``behaviour_key``.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
from mlx.utils import tree_flatten

from runtime.worker.model.attention_probe import call_attention


class MaskRefusal(ValueError):
    """An attention module whose masks the runtime cannot use; the message says why."""


def _attend(module: nn.Module, x: mx.array, mask: mx.array | None) -> mx.array | None:
    """``module``'s output on ``x`` with ``mask`` and no cache, or None where it fails."""
    try:
        out = call_attention(module, x, mask, None)
        if isinstance(out, tuple) and out:
            out = out[0]  # (output, state for later layers), as the probe takes it
        mx.eval(out)
    except Exception:  # a module that cannot run alone, or a mask that does not broadcast
        return None
    return out


_PLAIN = (int, float, str, bool, type(None))


def behaviour_key(module: nn.Module) -> tuple:
    """Attention modules with one key run the same code on the same shapes: the same classes
    and plain attributes (ints, floats, strings: head counts, RoPE bases, a recorded layer index, Phi-3-small's
    ``block_sparse``) in every submodule, and parameters of the same names, shapes and dtypes.
    The mask probes run once a key (each costs a forward; on a CPU in bf16 about a second a
    layer at the 8B shape), not once a layer."""
    plain = tuple((name, type(m).__name__, tuple(sorted((k, v) for k, v in vars(m).items() if isinstance(v, _PLAIN))))
                  for name, m in module.named_modules())
    params = tuple((name, a.shape, a.dtype) for name, a in tree_flatten(module.parameters()))
    return plain, params


def query_mask_rank(module: nn.Module, n_heads: int, dtype: mx.Dtype, width: int) -> int | None:
    """The rank a per-row decode mask must have to broadcast against ``module``'s scores:
    4 for (B, heads, L, T), 5 for queries grouped by hand as (B, kv_heads, n_rep, L, T)
    (gemma2). None when the module cannot be run alone on a plain input (left as 4).

    Probed at load with an all-true mask over a batch larger than every head count, so a mask
    of the wrong rank cannot broadcast silently (batch against a head axis): it fails or
    changes the output. Then a mask hiding the second key must hide it: a module that adds the
    boolean mask to its scores (Phi-3-small's block-sparse layers) would attend to the padding
    and pool slots the runtime masks, and is refused. ``n_heads``: its query heads; ``width``: its
    input width.
    """
    batch = n_heads + 1
    x = mx.random.normal((batch, 2, width), key=mx.random.key(0)).astype(dtype)  # fixed key: RNG untouched
    reference = _attend(module, x, None)
    if reference is None:
        return None
    for rank in (4, 5):
        out = _attend(module, x, mx.ones((batch,) + (1,) * (rank - 2) + (2,), dtype=mx.bool_))
        # An all-true mask changes nothing but rounding (masked kernels may differ from unmasked
        # ones in bf16); a mask of the wrong rank fails, or changes the shape or the values.
        if out is not None and out.shape == reference.shape and _close(out, reference):
            _check_mask_hides(module, x, rank, reference)
            return rank
    raise MaskRefusal(
        f"{type(module).__name__} attention accepts no per-row decode mask of rank 4 or 5; "
        "batched decode would be wrong, so this model is not served")


def _close(a: mx.array, b: mx.array) -> bool:
    return bool(mx.allclose(a, b, rtol=1e-2, atol=1e-2).item())


def _check_mask_hides(module: nn.Module, x: mx.array, rank: int, seen: mx.array) -> None:
    """Queries shown only the first key must see what the first token alone sees: closer to
    it than to ``seen`` (the output with both keys visible) by far, so that rounding (another
    kernel for one token, bf16) cannot refuse a module whose mask works."""
    first_only = mx.array([True, False]).reshape((1,) * (rank - 1) + (2,))
    hidden = _attend(module, x, mx.broadcast_to(first_only, (x.shape[0],) + first_only.shape[1:]))
    alone = _attend(module, x[:, :1], None)
    if hidden is None or alone is None:
        return  # a module that cannot run so: left to the token-exact tests
    missed = mx.abs(hidden[:, :1] - alone).max().item()
    if missed > 0.25 * mx.abs(seen[:, :1] - alone).max().item() and not _close(hidden[:, :1], alone):
        raise MaskRefusal(
            f"{type(module).__name__} attention does not hide the keys a boolean mask hides (it "
            "adds the mask to its scores?); padded and batched rows would be wrong, so this model "
            "is not served")
