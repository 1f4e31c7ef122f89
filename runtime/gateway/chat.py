"""Chat replies in OpenAI's shapes: ``content``, ``reasoning_content`` and ``tool_calls``.

One ``ChatReplies`` per request keeps a ``ReplyParser`` per choice, so a stream's deltas and
a whole message split the text the same way.
"""

from __future__ import annotations

from typing import Any

from runtime.client import GenerationResult
from runtime.gateway.reply_parser import Delta, ReplyParser
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

    def delta(self, index: int, text: str, finish: str | None) -> dict | None:
        """The ``delta`` for a streamed piece (the last one when ``finish`` is set); None when the
        piece is all held back."""
        parser = self._parsers[index]
        delta = parser.feed(text)
        if finish is not None:
            delta.add(parser.finish())
        if not delta and finish is None:
            return None
        return self._openai_delta(index, delta)

    def _openai_delta(self, index: int, delta: Delta) -> dict:
        out: dict = {}
        if delta.reasoning:
            out["reasoning_content"] = delta.reasoning
        if delta.content:
            out["content"] = delta.content
        if delta.tool_calls:
            calls = []
            for call in delta.tool_calls:
                calls.append({"index": self._tool_indices[index]} | call)
                self._tool_indices[index] += 1
            out["tool_calls"] = calls
        return out
