"""``POST /v1/responses``: OpenAI's Responses API over the chat path.

The body runs as a chat request (``responses_input.py``). Its reply is split by the same
``ReplyParser`` as a chat reply into reasoning, text and tool calls, which become the
response's output items in the order they were written: a ``reasoning`` item, a ``message``
with one ``output_text`` part, a ``function_call`` per call. Streamed, each item is announced,
filled by deltas and closed with the events OpenAI sends (``response.created``, ...,
``response.output_text.delta``, ..., ``response.completed``; ``response.incomplete`` when
``max_output_tokens`` ended it, ``response.failed`` with the error when the request failed
after it started). A function call is parsed whole, so its arguments come as one delta.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator, Callable

import msgspec
from fastapi import Depends, FastAPI
from fastapi.responses import JSONResponse, Response

from runtime.client import GenerationResult
from runtime.gateway import convert
from runtime.gateway.chat import open_think_end
from runtime.gateway.errors import failure
from runtime.gateway.fanout import ChoiceEvent, Fanout, first_event, results_of
from runtime.gateway.openai_types import ResponsesRequest
from runtime.gateway.reply_parser import Delta, ReplyParser
from runtime.gateway.responses_input import chat_request
from runtime.gateway.streaming import FanoutResponse
from runtime.gateway.tool_choice import plan_tools
from runtime.gateway.upstream import Gateway

_encode = msgspec.json.Encoder().encode


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class OutputItems:
    """A response's output items as the reply's deltas come in; ``feed``/``close`` return the
    stream events they make (dicts without ``sequence_number``)."""

    def __init__(self) -> None:
        self.items: list[dict] = []
        self._open: dict | None = None  # the reasoning or message item being written
        self._text: list[str] = []

    def feed(self, delta: Delta) -> list[dict]:
        events: list[dict] = []
        for kind, value in delta.parts:
            events += self._call(value) if kind == "tool" else self._write(
                "reasoning" if kind == "reasoning" else "message", value)
        return events

    def _call(self, call: dict) -> list[dict]:
        events = self.close()
        function = call["function"]
        item = {"type": "function_call", "id": _item_id("fc"), "call_id": call["id"], "name": function["name"],
                "arguments": function["arguments"], "status": "completed"}
        at = len(self.items)
        self.items.append(item)
        ids = {"item_id": item["id"], "output_index": at}
        return events + [
            {"type": "response.output_item.added", "output_index": at,
             "item": item | {"arguments": "", "status": "in_progress"}},
            {"type": "response.function_call_arguments.delta", **ids, "delta": item["arguments"]},
            {"type": "response.function_call_arguments.done", **ids, "arguments": item["arguments"]},
            {"type": "response.output_item.done", "output_index": at, "item": item},
        ]

    def _write(self, kind: str, text: str) -> list[dict]:
        events: list[dict] = []
        if self._open is None or self._open["type"] != kind:
            events += self.close()
            events += self._begin(kind)
        self._text.append(text)
        item, at = self._open, len(self.items) - 1
        assert item is not None
        name = "response.reasoning_text.delta" if kind == "reasoning" else "response.output_text.delta"
        event = {"type": name, "item_id": item["id"], "output_index": at, "content_index": 0, "delta": text}
        return events + [event | {"logprobs": []} if kind == "message" else event]

    def _begin(self, kind: str) -> list[dict]:
        at = len(self.items)
        if kind == "reasoning":
            item = {"type": "reasoning", "id": _item_id("rs"), "summary": [], "content": [], "status": "in_progress"}
            part = {"type": "reasoning_text", "text": ""}
        else:
            item = {"type": "message", "id": _item_id("msg"), "role": "assistant", "content": [],
                    "status": "in_progress"}
            part = {"type": "output_text", "text": "", "annotations": []}
        self._open = item
        self.items.append(item)
        return [{"type": "response.output_item.added", "output_index": at, "item": dict(item)},
                {"type": "response.content_part.added", "item_id": item["id"], "output_index": at, "content_index": 0,
                 "part": part}]

    def finish(self, parser: ReplyParser, rest: str) -> list[dict]:
        """The reply's last text, what the parser held back, and the open item closed."""
        delta = parser.feed(rest)
        delta.add(parser.finish())
        return self.feed(delta) + self.close()

    def close(self) -> list[dict]:
        """Close the open reasoning or message item, if any."""
        item, self._open = self._open, None
        if item is None:
            return []
        at, text = len(self.items) - 1, "".join(self._text)
        self._text = []
        if item["type"] == "reasoning":
            part, done = {"type": "reasoning_text", "text": text}, "response.reasoning_text.done"
        else:
            part, done = {"type": "output_text", "text": text, "annotations": []}, "response.output_text.done"
        item.update(content=[part], status="completed")
        ids = {"item_id": item["id"], "output_index": at, "content_index": 0}
        return [{"type": done, **ids, "text": text}, {"type": "response.content_part.done", **ids, "part": part},
                {"type": "response.output_item.done", "output_index": at, "item": item}]


class ResponseBody:
    """The fields of one response object; ``of`` gives it at a status, with its items and usage."""

    def __init__(self, body: ResponsesRequest, model: str) -> None:
        self.base = {
            "id": _item_id("resp"), "object": "response", "created_at": int(time.time()), "model": model,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens,
            "temperature": body.temperature, "top_p": body.top_p, "tools": body.tools or [],
            "tool_choice": body.tool_choice if body.tool_choice is not None else "auto",
            "parallel_tool_calls": body.parallel_tool_calls, "previous_response_id": None, "store": False,
            "text": body.text or {"format": {"type": "text"}}, "truncation": "disabled",
            "metadata": body.metadata or {}, "reasoning": None, "user": None,
        }

    def of(self, status: str, items: list[dict], result: GenerationResult | None = None,
           error: dict | None = None) -> dict:
        out = self.base | {"status": status, "output": items, "error": error, "incomplete_details": None,
                           "usage": None}
        if result is not None:
            usage = convert.usage([result], 1)
            out["usage"] = {"input_tokens": usage["prompt_tokens"], "output_tokens": usage["completion_tokens"],
                            "total_tokens": usage["total_tokens"], "input_tokens_details": usage["prompt_tokens_details"],
                            "output_tokens_details": {"reasoning_tokens": 0}}
            if _status(result) == "incomplete":
                out["incomplete_details"] = {"reason": "max_output_tokens"}
        return out


def add_responses_route(app: FastAPI, gw: Gateway, authorized: Callable) -> None:
    """Register ``POST /v1/responses`` on ``app`` for the gateway ``gw``."""

    @app.post("/v1/responses", dependencies=[Depends(authorized)])
    async def responses(body: ResponsesRequest) -> Response:
        gw.check(body.model)
        limits = await gw.ready_limits()
        chat = chat_request(body)
        markup = gw.markup()
        tools = plan_tools(chat.tools, chat.tool_choice, markup.tools)
        requests = convert.chat_requests(chat, limits, tools)
        think_end = open_think_end(markup, gw.tokens.tokenizer, chat.messages, tools.tools, chat.chat_template_kwargs)
        parser = ReplyParser(markup, tools=tools.tools, open_think_end=think_end)
        shape = ResponseBody(body, gw.model)
        fanout = Fanout(gw.client, requests, gw.metrics)
        if not body.stream:
            (result,) = await results_of(fanout)
            items = OutputItems()
            items.finish(parser, result.text)
            return JSONResponse(shape.of(_status(result), items.items, result))
        first = await first_event(fanout)
        return FanoutResponse(_events(first, fanout, parser, shape), fanout)


def _status(result: GenerationResult) -> str:
    return "incomplete" if convert.finish_reason(result) == "length" else "completed"


async def _events(first: ChoiceEvent, fanout: Fanout, parser: ReplyParser, shape: ResponseBody) -> AsyncIterator[bytes]:
    """The stream's server-sent events, each ``event: TYPE`` and its JSON with a sequence number."""
    items = OutputItems()
    sequence = 0

    def frames(events: list[dict]) -> bytes:
        nonlocal sequence
        out = []
        for e in events:
            e["sequence_number"] = sequence
            sequence += 1
            out.append(b"event: " + e["type"].encode() + b"\ndata: " + _encode(e) + b"\n\n")
        return b"".join(out)

    yield frames([{"type": "response.created", "response": shape.of("in_progress", [])},
                  {"type": "response.in_progress", "response": shape.of("in_progress", [])}])
    sent: list[str] = []
    event: ChoiceEvent | None = first
    while event is not None:
        if event.error is not None:
            error = failure(event.error)
            items.close()
            yield frames([{"type": "response.failed", "response": shape.of(
                "failed", items.items, error={"code": error.code or error.type, "message": error.message})}])
            return
        if event.chunk is not None:
            sent.append(event.chunk.text)
            out = items.feed(parser.feed(event.chunk.text))
        else:
            result = event.result
            assert result is not None
            text = "".join(sent)
            out = items.finish(parser, result.text[len(text):] if result.text.startswith(text) else "")
            status = _status(result)
            name = "response.incomplete" if status == "incomplete" else "response.completed"
            out.append({"type": name, "response": shape.of(status, items.items, result)})
        if out:
            yield frames(out)
        event = await fanout.next_event()
