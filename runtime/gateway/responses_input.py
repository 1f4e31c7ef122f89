"""A ``POST /v1/responses`` body as the chat request it runs as.

OpenAI's Responses API states a conversation as ``instructions`` and ``input`` items (messages,
the model's function calls, their outputs) where Chat Completions has ``messages``; its tools
are flat (``{"type": "function", "name": ...}``) and its structured output sits in
``text.format``. Each is rewritten here into the chat shapes the rest of the gateway serves,
so templates, tool calls, structured output and sampling behave exactly as on
``/v1/chat/completions``. No response is stored: ``previous_response_id`` is refused, and a
client sends the whole conversation each time (``store`` is ignored).
"""

from __future__ import annotations

import json
from typing import Any

from runtime.gateway.errors import ApiError
from runtime.gateway.openai_types import ChatCompletionRequest, ResponsesRequest

_ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}
_TEXT_PARTS = ("input_text", "output_text", "text", "summary_text", "reasoning_text")
# The chat route's sampling fields a Responses body passes on as they are.
_SAMPLING_FIELDS = ("model", "temperature", "top_p", "presence_penalty", "frequency_penalty", "logit_bias", "seed",
                    "stop", "top_k", "min_p", "repetition_penalty", "min_tokens", "ignore_eos", "stop_token_ids")


def chat_request(body: ResponsesRequest) -> ChatCompletionRequest:
    """The chat request that serves ``body``; ApiError 400 for what it cannot express."""
    if body.previous_response_id is not None:
        raise ApiError(400, "previous_response_id is not supported: this service stores no responses; "
                            "send the whole conversation in input", param="previous_response_id")
    if body.n != 1:
        raise ApiError(400, "n is not a Responses API parameter: one request makes one response", param="n")
    sampling = body.model_dump(include=set(_SAMPLING_FIELDS), exclude_none=True)
    return ChatCompletionRequest(
        **sampling,
        messages=chat_messages(body.instructions, body.input),
        max_tokens=body.max_output_tokens,
        tools=chat_tools(body.tools),
        tool_choice=chat_tool_choice(body.tool_choice),
        response_format=response_format(body.text),
        stream=body.stream,
        chat_template_kwargs=body.chat_template_kwargs,
    )


def chat_messages(instructions: str | None, items: str | list[dict[str, Any]]) -> list[dict]:
    """``instructions`` as a system message, then the input: a string is one user message."""
    messages: list[dict] = [{"role": "system", "content": instructions}] if instructions else []
    if isinstance(items, str):
        return messages + [{"role": "user", "content": items}]
    if not items:
        raise ApiError(400, "input must be a string or a non-empty list of items", param="input")
    for i, item in enumerate(items):
        kind = item.get("type", "message")
        where = f"input[{i}]"
        if kind == "message":
            role = _ROLES.get(item.get("role"))  # type: ignore[arg-type]
            if role is None:
                raise ApiError(400, f"{where}.role must be user, assistant, system or developer, got "
                                    f"{json.dumps(item.get('role'))[:40]}", param=f"{where}.role")
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {"id": _string(item, "call_id", where), "type": "function",
                    "function": {"name": _string(item, "name", where), "arguments": _string(item, "arguments", where)}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)  # the same turn: text, then its calls
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            output = item.get("output")
            messages.append({"role": "tool", "tool_call_id": _string(item, "call_id", where),
                             "content": output if isinstance(output, str) else _text(output, f"{where}.output")})
        elif kind == "reasoning":
            continue  # the model's own earlier reasoning: chat templates drop it from past turns too
        else:
            raise ApiError(400, f"{where}: input items of type {json.dumps(kind)[:40]} are not supported "
                                "(message, function_call, function_call_output and reasoning are)",
                           param=f"{where}.type")
    return messages


def _string(item: dict, key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str):
        raise ApiError(400, f"{where}.{key} must be a string", param=f"{where}.{key}")
    return value


def _text(content: Any, where: str) -> str:
    """A message's content as one string: a string, or text parts joined."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise ApiError(400, f"{where} must be a string or a list of text parts", param=where)
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind not in _TEXT_PARTS or not isinstance(part.get("text"), str):
            raise ApiError(400, f"{where}[{j}]: only text parts are supported (input_text, output_text), got "
                                f"{json.dumps(kind)[:40]}", param=f"{where}[{j}]")
        texts.append(part["text"])
    return "".join(texts)


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict] | None:
    """Flat function tools as chat tools; any other tool type is refused."""
    if tools is None:
        return None
    out = []
    for i, tool in enumerate(tools):
        if tool.get("type") != "function" or not isinstance(tool.get("name"), str):
            raise ApiError(400, f"tools[{i}]: only function tools with a name are supported, got type "
                                f"{json.dumps(tool.get('type'))[:40]}", param=f"tools[{i}]")
        function = {k: tool[k] for k in ("name", "description", "parameters", "strict") if tool.get(k) is not None}
        out.append({"type": "function", "function": function})
    return out


def chat_tool_choice(choice: Any) -> Any:
    """``{"type": "function", "name": X}`` as chat's ``{"type": "function", "function": {"name": X}}``."""
    if isinstance(choice, dict) and choice.get("type") == "function" and "name" in choice:
        return {"type": "function", "function": {"name": choice["name"]}}
    return choice


def response_format(text: dict[str, Any] | None) -> dict | None:
    """``text.format`` as chat's ``response_format``."""
    fmt = (text or {}).get("format")
    if fmt is None:
        return None
    if not isinstance(fmt, dict):
        raise ApiError(400, "text.format must be an object", param="text.format")
    if fmt.get("type") == "json_schema":
        return {"type": "json_schema", "json_schema": {k: fmt[k] for k in ("name", "schema", "strict") if k in fmt}}
    return fmt
