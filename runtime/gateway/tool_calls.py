"""The model's reply markup, chosen as mlx-lm does, and tool-call texts to OpenAI's shape.

The tool parser and thinking markers come from the installed mlx-lm (``tool_parsers/`` and
``tokenizer_utils``'s inference from the chat template and vocabulary), loaded under a private
package name so the gateway never runs ``mlx_lm/__init__`` (which imports mlx).
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import logging
import sys
import types
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_PACKAGE = "_runtime_mlx_lm"
# Always recognised: the common thinking pair, even where it is not a single vocabulary token.
DEFAULT_THINK = ("<think>", "</think>")

log = logging.getLogger(__name__)


def mlx_lm_module(name: str) -> ModuleType:
    """``mlx_lm.<name>`` from the installed mlx-lm, without importing the ``mlx_lm`` package itself."""
    if _PACKAGE not in sys.modules:
        spec = importlib.util.find_spec("mlx_lm")  # a top-level spec: found, not executed
        if spec is None or not spec.submodule_search_locations:
            raise RuntimeError("mlx-lm is not installed; the gateway needs its tool parsers")
        package = types.ModuleType(_PACKAGE)
        package.__path__ = list(spec.submodule_search_locations)
        sys.modules[_PACKAGE] = package
    return importlib.import_module(f"{_PACKAGE}.{name}")


@dataclass(frozen=True)
class ToolSyntax:
    """One mlx-lm tool parser: its markers and ``parse(text_between_markers, tools)``.

    An empty ``end`` (Mistral's ``[TOOL_CALLS]``) means the call runs to the end of the reply.
    """

    name: str
    start: str
    end: str
    parse: Callable[[str, Any], Any]


@dataclass(frozen=True)
class Markup:
    """What a model folder's replies may contain: thinking marker pairs and a tool-call syntax."""

    think: tuple[tuple[str, str], ...]
    tools: ToolSyntax | None
    chat_template: str | None = None

    def open_think_end(self, prompt_text: str) -> str | None:
        """The end marker of a thinking block the rendered prompt leaves open (its generation
        prompt opened one), else None."""
        for start, end in self.think:
            if prompt_text.rfind(start) > prompt_text.rfind(end):  # rfind is -1 when absent
                return end
        return None

    @property
    def template_may_think(self) -> bool:
        """Only a template that writes a thinking marker can open a block in the prompt."""
        return bool(self.chat_template) and any(start in self.chat_template for start, _ in self.think)


def tool_parser_name(hf_tokenizer: Any) -> str | None:
    """The mlx-lm parser module for a tokenizer: ``tool_parser_type`` in tokenizer_config.json,
    else mlx-lm's inference from the chat template text, then the vocabulary."""
    configured = getattr(hf_tokenizer, "init_kwargs", {}).get("tool_parser_type")
    if configured:
        return str(configured)
    return mlx_lm_module("tokenizer_utils")._infer_tool_parser(hf_tokenizer)


def load_markup(hf_tokenizer: Any) -> Markup:
    """The markup of a transformers tokenizer's model, chosen the way mlx-lm's server chooses."""
    think = [DEFAULT_THINK]
    start, end, *_ = mlx_lm_module("tokenizer_utils")._infer_thinking(hf_tokenizer)
    if start is not None and (start, end) != DEFAULT_THINK:
        think.insert(0, (start, end))
    name = tool_parser_name(hf_tokenizer)
    syntax = None
    if name is not None:
        module = mlx_lm_module(f"tool_parsers.{name}")
        syntax = ToolSyntax(name, module.tool_call_start, module.tool_call_end or "", module.parse_tool_call)
    template = hf_tokenizer.chat_template if isinstance(hf_tokenizer.chat_template, str) else None
    return Markup(tuple(think), syntax, template)


def parse_tool_calls(syntax: ToolSyntax, text: str, tools: list[dict] | None) -> list[dict] | None:
    """OpenAI tool calls ``{id, type, function: {name, arguments}}`` from one call's text, or None
    when the parser refuses it (a call cut off by max_tokens, say)."""
    try:
        parsed = syntax.parse(text, tools)
    except Exception as exc:  # the parsers raise ValueError, JSONDecodeError, SyntaxError, KeyError ...
        log.warning("unparsable %s tool call (%s: %s)", syntax.name, type(exc).__name__, exc)
        return None
    calls = []
    for call in parsed if isinstance(parsed, list) else [parsed]:
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            log.warning("the %s tool parser returned no function name: %r", syntax.name, call)
            return None
        arguments = call.get("arguments", {})
        if not isinstance(arguments, str):
            arguments = json.dumps(arguments, ensure_ascii=False)
        calls.append({"id": call.get("id") or f"call_{uuid.uuid4().hex[:24]}", "type": "function",
                      "function": {"name": call["name"], "arguments": arguments}})
    return calls
