"""Gemma-style RMSNorms with their ``1 + weight`` computed once, at load.

Gemma, Gemma 2, Gemma 3, RecurrentGemma and others normalize with
``mx.fast.rms_norm(x, 1.0 + self.weight, self.eps)``: every call adds 1 to the weight first, one
more kernel (and on a GPU, one more launch encoded by the host) for every norm of every step.
A Gemma 3 block has six such norms (four around its sublayers, two on queries and keys), so a
one-row decode step of a 26-layer model launches some 160 of these adds. ``precompute_offsets``
gives each such norm a subclass that reads the sum computed once (the same operation on the
same weight: the same bits), held outside the module's parameters. Only the instances' classes
change; the module tree and its parameters stay as loaded. A norm whose weight was replaced
after the transform computes the sum again itself.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.model.logit_probe import LogitProbe


class _Held:
    """The weight a sum was computed from and the sum: a plain object, so the module holding it
    does not count it among its parameters."""

    __slots__ = ("source", "value")

    def __init__(self, source: mx.array, value: mx.array) -> None:
        self.source, self.value = source, value


def is_offset_norm(module: object) -> bool:
    """Whether ``module`` is a norm this module changed (it holds its ``1 + weight``)."""
    return isinstance(module, nn.Module) and isinstance(getattr(module, "held_weight", None), _Held)


def effective_weight(module: nn.Module) -> mx.array:
    """The weight an offset norm normalizes with: its held ``1 + weight`` (computed again if the
    weight was replaced since)."""
    held: _Held = module.held_weight
    return held.value if held.source is module.weight else 1.0 + module.weight


def _offset_call(self, x: mx.array) -> mx.array:
    return mx.fast.rms_norm(x, effective_weight(self), self.eps)


@functools.cache
def _offset_class(cls: type) -> type:
    return type(f"Held{cls.__name__}", (cls,), {"__call__": _offset_call})


def _is_one(node: ast.expr) -> bool:
    return isinstance(node, ast.Constant) and type(node.value) in (int, float) and node.value == 1


def _self_attr(node: ast.expr | None, name: str) -> bool:
    return (isinstance(node, ast.Attribute) and node.attr == name and isinstance(node.value, ast.Name)
            and node.value.id == "self")


@functools.cache
def adds_one(cls: type) -> bool:
    """Whether ``cls.__call__`` is exactly ``return mx.fast.rms_norm(x, 1 + self.weight, self.eps)``
    (the weight and eps positional or by keyword)."""
    try:
        if list(inspect.signature(cls.__call__).parameters) != ["self", "x"]:
            return False
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    except (OSError, TypeError, ValueError, SyntaxError):
        return False
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef) or len(function.body) != 1:
        return False
    ret = function.body[0]
    if not isinstance(ret, ast.Return) or not isinstance(ret.value, ast.Call):
        return False
    call = ret.value
    if ast.unparse(call.func) != "mx.fast.rms_norm":
        return False
    args = list(call.args) + [None] * (3 - len(call.args))
    keywords = {k.arg: k.value for k in call.keywords}
    if len(call.args) > 3 or None in keywords:
        return False
    x, weight, eps = args[0], args[1] or keywords.get("weight"), args[2] or keywords.get("eps")
    if not (isinstance(x, ast.Name) and x.id == "x") or set(keywords) - {"weight", "eps"}:
        return False
    if not (isinstance(weight, ast.BinOp) and isinstance(weight.op, ast.Add)):
        return False
    one_plus = _is_one(weight.left) and _self_attr(weight.right, "weight")
    plus_one = _self_attr(weight.left, "weight") and _is_one(weight.right)
    return (one_plus or plus_one) and _self_attr(eps, "eps")


def precompute_offsets(model: nn.Module, vocab_size: int, probe: LogitProbe | None = None) -> int:
    """Give every ``1 + weight`` RMSNorm of ``model`` its sum computed once, where the model's
    logits on a probe prompt stay bit-identical (else none); how many norms were changed.
    ``probe``: the loader's, shared by its transformations (its reference computed once)."""
    chosen = [m for _, m in model.named_modules()
              if isinstance(m, nn.Module) and isinstance(m.get("weight"), mx.array)
              and not hasattr(m, "held_weight") and adds_one(type(m))]
    if not chosen:
        return 0
    probe = probe or LogitProbe(model, vocab_size)
    if probe.reference() is None:
        return 0
    originals = [type(m) for m in chosen]
    for module in chosen:
        module.held_weight = _Held(module["weight"], 1.0 + module["weight"])
        module.__class__ = _offset_class(type(module))
    mx.eval([m.held_weight.value for m in chosen])
    if not probe.unchanged():
        for module, cls in zip(chosen, originals):
            module.__class__ = cls
            del module.held_weight
        return 0
    return len(chosen)
