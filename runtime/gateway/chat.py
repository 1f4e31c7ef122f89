"""Chat replies in OpenAI's shapes: ``content``, ``reasoning_content`` and ``tool_calls``.

One ``ChatReplies`` per request keeps a ``ReplyParser`` per choice, so a stream's deltas and
a whole message split the text the same way.
"""

from __future__ import annotations

from typing import Any

from runtime.client import GenerationResult
from runtime.gateway.reply_parser import ReplyParser
from runtime.gateway.tool_calls import Markup


def open_think_end(markup: Markup, hf_tokenizer: Any, messages: list[dict], tools: list[dict] | None,
                   template_kwargs: dict | None) -> str | None:
    """The thinking block the rendered prompt leaves open, if any: rendered here as the
    scheduler renders it, only for templates that write a thinking marker at all."""
    if not markup.template_may_think:
        return None
    try:
        text = hf_tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False,
                                                **(template_kwargs or {}))
    except Exception:  # the scheduler renders it again and reports the template's error
        return None
    return markup.open_think_end(text) if isinstance(text, str) else None


class ChatReplies:
    """The parsers of one request's choices and the message, delta and finish reason of each."""

    def __init__(self, markup: Markup, count: int, tools: list[dict] | None, think_end: str | None) -> None:
        self._parsers = [ReplyParser(markup, tools=tools, open_think_end=think_end) for _ in range(count)]
        self._tool_indices = [0] * count

    def finish_reason(self, index: int, reason: str) -> str:
        return "tool_calls" if reason == "stop" and self._parsers[index].made_tool_call else reason

    def message(self, index: int, result: GenerationResult, reason: str) -> tuple[dict, str]:
        """The whole ``message`` of choice ``index`` and its finish reason."""
        parser = self._parsers[index]
        delta = parser.feed(result.text)
        delta.add(parser.finish())
        message: dict = {"role": "assistant", "content": delta.content}
        if delta.reasoning:
            message["reasoning_content"] = delta.reasoning
        if delta.tool_calls:
            message["tool_calls"] = delta.tool_calls
            message["content"] = delta.content if delta.content.strip() else None
        return message, self.finish_reason(index, reason)

    def deltas(self, index: int, text: str, finish: str | None) -> list[dict]:
        """The ``delta`` objects of a streamed piece (the last one when ``finish`` is set), each
        for a chunk of its own: the text, then per completed tool call a header delta (``index``,
        ``id``, ``type``, ``function.name``) and an arguments delta, as OpenAI streams them.
        Empty while the piece is all held back; the last piece has at least one (maybe ``{}``)."""
        parser = self._parsers[index]
        delta = parser.feed(text)
        if finish is not None:
            delta.add(parser.finish())
        out: list[dict] = []
        if delta.reasoning:
            out.append({"reasoning_content": delta.reasoning})
        if delta.content:
            if out:
                out[0]["content"] = delta.content
            else:
                out.append({"content": delta.content})
        for call in delta.tool_calls:
            # A call is parsed whole (mlx-lm's parsers take the text between the markers), so its
            # arguments come as one fragment right after its header.
            at = self._tool_indices[index]
            self._tool_indices[index] += 1
            function = call["function"]
            out.append({"tool_calls": [{"index": at, "id": call["id"], "type": call["type"],
                                        "function": {"name": function["name"], "arguments": ""}}]})
            out.append({"tool_calls": [{"index": at, "function": {"arguments": function["arguments"]}}]})
        if not out and finish is not None:
            out.append({})
        return out
