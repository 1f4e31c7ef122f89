"""A chat request's ``tool_choice``: which tools reach the chat template, and what forces a call.

- absent or ``"auto"``: the tools go to the template; the reply may call one.
- ``"none"``: the template never sees the tools and the reply is all text.
- ``"required"`` or ``{"type": "function", "function": {"name": X}}``: the reply is one call
  (of X, or of any tool), its arguments valid for that tool's ``parameters`` schema. The
  scheduler enforces it with a grammar (structured output, llguidance) written here for the
  model's tool-call syntax; a syntax without a grammar here is refused with a 400 naming
  ``tool_choice``, never silently ignored.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from runtime.gateway.errors import ApiError
from runtime.gateway.tool_calls import ToolSyntax

# Fixed separators and no free whitespace in the forced JSON: a weak model left free to
# choose whitespace can fill max_tokens with blanks between two keys.
_JSON_LAYOUT = {"whitespace_flexible": False, "key_separator": ": ", "item_separator": ", "}
_CHOICES = '"none", "auto", "required" or {"type": "function", "function": {"name": ...}}'


@dataclass(frozen=True)
class ToolPlan:
    """``tools``: for the template and the reply parser (None: neither sees any); ``grammar``:
    Lark text that forces a call, or None."""

    tools: list[dict] | None
    grammar: str | None = None


def _json_tools_grammar(calls: list[dict]) -> str:
    """Qwen/Hermes style, as mlx-lm's json_tools parser reads it: ``<tool_call>``, a JSON
    ``{"name": ..., "arguments": {...}}``, ``</tool_call>``."""
    schema = {"x-guidance": _JSON_LAYOUT} | (calls[0] if len(calls) == 1 else {"anyOf": calls})
    return f'start: "<tool_call>\\n" call "\\n</tool_call>"\ncall: %json {json.dumps(schema)}\n'


_FORCING: dict[str, Callable[[list[dict]], str]] = {"json_tools": _json_tools_grammar}
"""Tool-call syntaxes (mlx-lm parser names) whose calls can be forced, and their grammar."""


def _function(tool: Any) -> dict:
    function = tool.get("function") if isinstance(tool, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, 'each tool must be {"type": "function", "function": {"name": ..., "parameters": ...}}',
                       param="tools")
    return function


def _call_schema(function: dict) -> dict:
    """One call of ``function``: its name, then arguments valid for its parameters."""
    parameters = function.get("parameters") or {"type": "object"}
    if not isinstance(parameters, dict):
        raise ApiError(400, f"the parameters of tool {function['name']!r} must be a JSON Schema object",
                       param="tools")
    return {"type": "object", "properties": {"name": {"const": function["name"]}, "arguments": parameters},
            "required": ["name", "arguments"], "additionalProperties": False}


def _forced_names(tool_choice: Any, names: list[str]) -> list[str]:
    """The tools one of which must be called (``tool_choice`` is neither absent, "auto" nor "none")."""
    if tool_choice == "required":
        return names
    function = tool_choice.get("function") if isinstance(tool_choice, dict) else None
    if (not isinstance(tool_choice, dict) or tool_choice.get("type") != "function" or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)):
        raise ApiError(400, f"tool_choice must be {_CHOICES}, got {json.dumps(tool_choice)[:200]}",
                       param="tool_choice")
    if function["name"] not in names:
        raise ApiError(400, f"tool_choice names the function {function['name']!r}, which is not in tools "
                            f"({', '.join(map(repr, names)) or 'none given'})", param="tool_choice")
    return [function["name"]]


def plan_tools(tools: list[dict] | None, tool_choice: Any, syntax: ToolSyntax | None) -> ToolPlan:
    """What ``tools`` and ``tool_choice`` make of a request; ApiError 400 for what cannot be honoured."""
    if tool_choice == "none":
        return ToolPlan(None)
    if tool_choice is None or tool_choice == "auto":
        return ToolPlan(tools)  # the template takes them as they are
    functions = [_function(tool) for tool in tools or []]
    forced = _forced_names(tool_choice, [f["name"] for f in functions])
    if not forced:
        raise ApiError(400, 'tool_choice "required" needs at least one tool in tools', param="tool_choice")
    make = _FORCING.get(syntax.name) if syntax is not None else None
    if make is None:
        which = (f"its tool-call syntax is {syntax.name!r}" if syntax is not None
                 else "its chat template names no tool-call syntax")
        raise ApiError(400, f"tool_choice {json.dumps(tool_choice)[:200]} cannot be enforced for this model "
                            f"({which}; calls can be forced in {', '.join(sorted(_FORCING))} only); "
                            'use tool_choice "auto"', param="tool_choice")
    calls = [_call_schema(f) for f in functions if f["name"] in forced]
    return ToolPlan(tools, make(calls))
