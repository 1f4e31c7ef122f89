"""Which decoder blocks have the pre-norm shape ``fused_residual`` replaces, read from their code.

A block's forward is parsed (``ast``): it must take ``(x, mask, cache)``, be straight-line code
calling nothing but its parts (attention, feed-forward, norms; module-level ``HELPERS``), or
start by picking its mixer by a per-layer flag. ``NAMINGS`` are the part names blocks use. What
the code computes is then checked by the load-time probe's logits, bit for bit; this rules out
blocks that branch on anything one probe prompt could miss.
"""

from __future__ import annotations

import ast
import functools
import inspect
import textwrap
from typing import NamedTuple


class Parts(NamedTuple):
    """The names of what a fused block calls."""

    mixer: str  # the attention (or what a layer flag picks in its place)
    first_norm: str  # before the mixer
    second_norm: str  # after the first residual add, before the feed-forward
    feed_forward: str = ""
    mixer_out: str = ""  # a norm of the mixer's output before its add (Gemma 2 and 3), if any
    feed_forward_out: str = ""  # a norm of the feed-forward's output before its add, if any
    residual_scale: str = ""  # a number each sublayer's output is scaled by before its add (Granite's), if any
    extra: tuple[str, ...] = ()  # what the forward takes besides (x, mask, cache): ``SIGNATURES``

    @property
    def norms(self) -> tuple[str, ...]:
        return tuple(n for n in (self.first_norm, self.second_norm, self.mixer_out, self.feed_forward_out) if n)


# How blocks name their parts, the first naming whose norms a block has taken: Gemma 2 and 3 (a
# norm on each sublayer's output too, the first residual add followed by
# ``pre_feedforward_layernorm``), GLM-4 (the same under other names), Llama's, then others'. The
# feed-forward is one of ``FEED_FORWARD``: ``mlp``, Mixtral's ``block_sparse_moe``, Llama 4's and
# InternLM2's ``feed_forward``.
LLAMA = Parts("self_attn", "input_layernorm", "post_attention_layernorm")
NAMINGS = (
    Parts("self_attn", "input_layernorm", "pre_feedforward_layernorm", mixer_out="post_attention_layernorm",
          feed_forward_out="post_feedforward_layernorm"),  # Gemma 2's and 3's
    Parts("self_attn", "input_layernorm", "post_attention_layernorm", mixer_out="post_self_attn_layernorm",
          feed_forward_out="post_mlp_layernorm"),  # GLM-4's
    LLAMA,
    Parts("attention", "attention_norm", "ffn_norm"),  # InternLM2's
    Parts("self_attn", "attention_layernorm", "feedforward_layernorm"),  # Apertus's
    Parts("self_attn", "operator_norm", "ffn_norm"),  # LFM2's (its mixer by layer: attention or a convolution)
)
FEED_FORWARD = ("mlp", "block_sparse_moe", "feed_forward")
# Module-level helpers a block's forward may call: Gemma 3's ``clip_residual`` is ``x + y`` except
# in float16 (where it clips; such blocks are not fused).
HELPERS = ("clip_residual",)


def self_attr(node: ast.AST) -> str | None:
    """``name`` for ``self.name``, else None."""
    if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "self":
        return node.attr
    return None


def flag_branch(node: ast.If) -> tuple[str, str, str] | None:
    """(flag, mixer if set, mixer if not) for ``if self.flag: r = self.a(...) else: r = self.b(...)``."""
    flag = self_attr(node.test)
    arms = []
    for arm in (node.body, node.orelse):
        if not (len(arm) == 1 and isinstance(arm[0], ast.Assign) and len(arm[0].targets) == 1
                and isinstance(arm[0].targets[0], ast.Name) and isinstance(arm[0].value, ast.Call)):
            return None
        arms.append((arm[0].targets[0].id, self_attr(arm[0].value.func)))
    (target_a, mixer_a), (target_b, mixer_b) = arms
    if flag is None or mixer_a is None or mixer_b is None or target_a != target_b:
        return None
    return flag, mixer_a, mixer_b


# What a fused forward takes: ``(x, mask, cache)``, or Ministral 3's and Mistral 4's ``(x,
# attn_scale, mask, cache)`` (the attention takes ``attn_scale`` after its input).
SIGNATURES = (("self", "x", "mask", "cache"), ("self", "x", "attn_scale", "mask", "cache"))


class Plan(NamedTuple):
    """How a block's forward picks its mixer (``flag``: None, or the per-layer attribute that
    picks ``when_set`` over ``otherwise``) and what it takes besides ``(x, mask, cache)``."""

    flag: str | None
    when_set: str
    otherwise: str
    extra: tuple[str, ...] = ()


@functools.cache
def forward_plan(cls: type, naming: Parts, feed_forward: str) -> Plan | None:
    """How ``cls.__call__`` picks its token mixer, if it has the shape the fused forward
    replaces: (None, attention, attention) for straight-line code that calls nothing but the
    block's parts (``naming``: its attention and norms; module-level ``HELPERS`` too); (flag, a,
    b) where it starts ``if self.flag: r = self.a(...) else: r = self.b(...)`` (Qwen3-Next's
    linear and full attention layers, a per-layer constant) and is straight-line after; None
    otherwise. The forward must take one of ``SIGNATURES``, as the fused one does. The probe's
    logits check what the code does; this rules out branches on anything one probe prompt
    could miss."""
    try:
        params = tuple(inspect.signature(cls.__call__).parameters)
        if params not in SIGNATURES:
            return None
        tree = ast.parse(textwrap.dedent(inspect.getsource(cls.__call__)))
    except (OSError, TypeError, ValueError, SyntaxError):
        return None
    function = tree.body[0]
    if not isinstance(function, ast.FunctionDef) or not function.body:
        return None
    plan = Plan(None, naming.mixer, naming.mixer, params[2:-2])
    statements = list(function.body)
    if isinstance(statements[0], ast.If):
        branch = flag_branch(statements[0])
        if branch is None:
            return None
        plan = Plan(*branch, params[2:-2])
        statements = [*statements[0].body, *statements[0].orelse, *statements[1:]]
    parts = {plan[1], plan[2], feed_forward, *naming.norms, *([naming.residual_scale] if naming.residual_scale else [])}
    for node in ast.walk(ast.Module(body=statements, type_ignores=[])):
        if isinstance(node, (ast.If, ast.IfExp, ast.For, ast.While, ast.Try, ast.With, ast.Lambda, ast.comprehension)):
            return None
        helper = isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in HELPERS
        if isinstance(node, ast.Call) and not helper and self_attr(node.func) not in parts:
            return None
        if isinstance(node, ast.Attribute) and node.attr not in parts:
            return None
    return plan
