"""Pre-norm blocks whose residual adds and the RMSNorms after them run as one operation.

A Llama-style block computes ``h = x + attn(norm1(x))``, ``out = h + mlp(norm2(h))``, and the
next layer (or the model's final norm) starts with ``norm(out)``. ``fuse_residuals`` gives such
blocks a forward that asks one ``AddRmsNorm`` call for each add and the norm after it (``h``
with ``norm2(h)``; ``out`` with the next norm's row, handed to that norm, which returns it
when called on ``out`` itself). On a GPU that is one kernel for two (``paths/cuda/add_rms_norm``);
elsewhere MLX's own two (the same bits, which is what the load-time probe checks).

Which blocks qualify, and what their parts are called, is read from their code
(``block_parts``): Llama's shape under several namings (Mixtral's, Llama 4's, InternLM2's,
Apertus's, LFM2's), a norm on each sublayer's output before its add (Gemma 2 and 3, GLM-4; the
Gemma norms' ``1 + weight`` held by ``norm_offsets``), Granite's residual multiplier, a mixer
picked by a per-layer flag (Qwen3-Next's and LFM2's), and Ministral 3's and Mistral 4's
``attn_scale`` passed on to the attention. 67 of the test factory's 123 model types take it.

Only the instances' classes change (a subclass with another ``__call__``), never the module
tree: parameters, discovery and the other wrappers see the model as loaded. A model is changed
only where its forward's logits stay bit-identical on a probe prompt; else it is left as it was.
"""

from __future__ import annotations

import functools

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.model.block_parts import FEED_FORWARD, NAMINGS, Parts, forward_plan
from runtime.worker.model.discovery import layers_owner
from runtime.worker.model.logit_probe import LogitProbe
from runtime.worker.model.norm_offsets import effective_weight, is_offset_norm
from runtime.worker.paths.cuda.add_rms_norm import AddRmsNorm

class _Handoff:
    """The row a block computed for a norm (``n``) and the array it normalizes (``h``): a plain
    object, so a module holding it does not count it among its parameters."""

    __slots__ = ("h", "n")

    def __init__(self) -> None:
        self.h: mx.array | None = None
        self.n: mx.array | None = None


def _handoff_call(self, x: mx.array) -> mx.array:
    """The row handed to the norm when called on the array it was computed for, else the norm's
    own ``inner_call``."""
    if self.handoff.h is x:
        n = self.handoff.n
        self.handoff.h = self.handoff.n = None  # nothing kept past its use
        assert n is not None
        return n
    return type(self).inner_call(self, x)


class HandoffRMSNorm(nn.RMSNorm):
    """An RMSNorm that returns the row handed to it when called on the array it was computed
    for (the previous block's output), and normalizes anything else itself."""

    handoff: _Handoff
    __call__ = _handoff_call
    inner_call = nn.RMSNorm.__call__


@functools.cache
def _handoff_class(cls: type) -> type:
    """``cls`` returning the row handed to it (as ``HandoffRMSNorm`` for MLX's RMSNorm)."""
    if cls is nn.RMSNorm:
        return HandoffRMSNorm
    return type(f"Handoff{cls.__name__}", (cls,), {"__call__": _handoff_call, "inner_call": cls.__call__})


def _is_handoff(module: object) -> bool:
    return getattr(type(module), "__call__", None) is _handoff_call


def _is_rms_norm(module: object) -> bool:
    """An RMSNorm whose weight ``_norm_weight`` knows: MLX's, or a norm holding its ``1 + weight``."""
    return type(module) in (nn.RMSNorm, HandoffRMSNorm) or is_offset_norm(module)


def _norm_weight(norm: nn.Module) -> mx.array:
    return effective_weight(norm) if is_offset_norm(norm) else norm.weight


class _Links:
    """What a fused block calls: the add-and-norm operation, the norm its output goes to and the
    names of its parts."""

    __slots__ = ("add_norm", "next_norm", "parts")

    def __init__(self, add_norm: AddRmsNorm, next_norm: HandoffRMSNorm | None, parts: Parts) -> None:
        self.add_norm, self.next_norm, self.parts = add_norm, next_norm, parts


def _fused_forward(self, x: mx.array, extra: tuple, mask, cache) -> mx.array:
    """A pre-norm block's forward with each residual add fused with the norm after it;
    ``extra``: what the attention takes after its input besides the mask and cache."""
    links: _Links = self.fused_links
    parts = links.parts
    r = self[parts.mixer](self[parts.first_norm](x), *extra, mask, cache)
    if parts.mixer_out:
        r = self[parts.mixer_out](r)
    if parts.residual_scale:
        r = r * getattr(self, parts.residual_scale)
    post = self[parts.second_norm]
    h, n = links.add_norm(x, r, _norm_weight(post), post.eps)
    r = self[parts.feed_forward](n)
    if parts.feed_forward_out:
        r = self[parts.feed_forward_out](r)
    if parts.residual_scale:
        r = r * getattr(self, parts.residual_scale)
    nxt = links.next_norm
    if nxt is None:
        return h + r
    out, n = links.add_norm(h, r, _norm_weight(nxt), nxt.eps)
    nxt.handoff.h, nxt.handoff.n = out, n
    return out


def _fused_call(self, x: mx.array, mask=None, cache=None) -> mx.array:
    return _fused_forward(self, x, (), mask, cache)


def _fused_call_scaled(self, x: mx.array, attn_scale=None, mask=None, cache=None) -> mx.array:
    return _fused_forward(self, x, (attn_scale,), mask, cache)


_FUSED_CALLS = {(): _fused_call, ("attn_scale",): _fused_call_scaled}


@functools.cache
def _fused_class(cls: type, extra: tuple[str, ...]) -> type:
    """``cls`` with the fused forward taking what its own takes (one subclass per block class)."""
    return type(f"Fused{cls.__name__}", (cls,), {"__call__": _FUSED_CALLS[extra]})


# The model's norm after its last block: ``norm`` (LFM2: ``embedding_norm``).
_FINAL_NORMS = ("norm", "embedding_norm")


def _final_norm(owner: nn.Module) -> nn.Module | None:
    """The norm the last block's output goes to, where it is one the fused add can compute."""
    found = next((owner[n] for n in _FINAL_NORMS if n in owner), None)
    return found if _is_rms_norm(found) else None


def _parts(block: object) -> Parts | None:
    """What a pre-norm block calls, or None: not such a block."""
    if not isinstance(block, nn.Module):
        return None
    naming = next((n for n in NAMINGS if all(name in block for name in n.norms)), None)
    feed_forward = next((n for n in FEED_FORWARD if n in block), None)
    if naming is None or feed_forward is None:
        return None
    if not (_is_rms_norm(block[naming.second_norm]) and _is_rms_norm(block[naming.first_norm])):
        return None  # the fused norms (the first one is the previous block's handoff)
    if naming.mixer_out and block[naming.second_norm].weight.dtype == mx.float16:
        return None  # Gemma 3 clips its residual sums in float16
    if type(getattr(block, "residual_multiplier", None)) in (int, float):
        naming = naming._replace(residual_scale="residual_multiplier")
    plan = forward_plan(type(block), naming, feed_forward)
    if plan is None:
        return None
    if plan.flag is not None and not isinstance(getattr(block, plan.flag, None), bool):
        return None  # a flag that is not a plain per-layer constant
    mixer = plan.when_set if plan.flag is not None and getattr(block, plan.flag) else plan.otherwise
    found = naming._replace(mixer=mixer, feed_forward=feed_forward, extra=plan.extra)
    return found if mixer in block else None


def fuse_residuals(model: nn.Module, add_norm: AddRmsNorm, vocab_size: int, probe: LogitProbe | None = None) -> int:
    """Give every Llama-style block of ``model`` the fused forward where the model's logits on a
    probe prompt stay bit-identical (with MLX's own kernels for the fused operation); the number
    of blocks changed (0: the model is as it was). ``add_norm``'s kernel, if it has one, is then
    checked against MLX's bits at the model's width and dropped if it differs (``problem``).
    ``probe``: the loader's, shared by its transformations (its reference computed once)."""
    owner = layers_owner(model)
    if owner is None:
        return 0
    layers = owner.layers
    parts = [_parts(block) for block in layers]
    chosen = [i for i, found in enumerate(parts) if found is not None]
    if not chosen:
        return 0
    probe = probe or LogitProbe(model, vocab_size)
    if probe.reference() is None:
        return 0
    norms = [layers[i + 1][parts[i + 1].first_norm] if i + 1 in chosen else None for i in range(len(layers))]
    final = _final_norm(owner)
    if final is not None:
        norms[-1] = final
    changed: list[tuple[nn.Module, type]] = []

    def swap(module: nn.Module, cls: type) -> None:
        changed.append((module, type(module)))
        module.__class__ = cls

    reference = AddRmsNorm(False)
    for norm in {id(n): n for n in norms if n is not None}.values():
        if not _is_handoff(norm):
            swap(norm, _handoff_class(type(norm)))
        norm.handoff = _Handoff()
    for i in chosen:
        block = layers[i]
        swap(block, _fused_class(type(block), parts[i].extra))
        block.fused_links = _Links(reference, norms[i], parts[i])
    if not probe.unchanged():
        for module, cls in reversed(changed):
            module.__class__ = cls
        return 0
    if add_norm.use_kernel:
        if final is None:
            final = layers[chosen[0]][parts[chosen[0]].second_norm]
        add_norm.problem = add_norm.check(final.weight.shape[0], final.weight.dtype)
        add_norm.use_kernel = add_norm.problem is None
    for i in chosen:
        layers[i].fused_links.add_norm = add_norm
    return len(chosen)
