"""Tool calls and reasoning in chat replies: the reply state machine on given text pieces, the
parser choice from chat templates, and the real service (the adder, with a tools template)."""

from __future__ import annotations

import json

import openai
import pytest
from conftest import REPO, running_config
from model_factory import with_chat_template
from test_gateway import START_TIMEOUT_S, Gateway, _free_port, _wait_for_line

from runtime.gateway.chat import ChatReplies
from runtime.gateway.reply_parser import ReplyParser, parse_reply
from runtime.gateway.tool_calls import Markup, ToolSyntax, load_markup, mlx_lm_module

TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                           "parameters": {"type": "object",
                                                          "properties": {"city": {"type": "string"}}}}}]
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
# The adder copy's template: "N\n" first when N tools are given; it names Qwen's JSON call syntax
# (<tool_call> and tool_call.name), from which mlx-lm picks the json_tools parser.
ADDER_TEMPLATE = (
    "{%- if tools %}{{ tools | length }}\n{% endif %}{{ messages[-1]['content'] }}"
    "{#- calls render as <tool_call>{\"name\": tool_call.name}</tool_call> #}"
)


def _markup(parser: str = "json_tools") -> Markup:
    module = mlx_lm_module(f"tool_parsers.{parser}")
    syntax = ToolSyntax(parser, module.tool_call_start, module.tool_call_end, module.parse_tool_call)
    return Markup((("<think>", "</think>"),), syntax)


def _pieces(text: str, size: int) -> list[str]:
    return [text[i:i + size] for i in range(0, len(text), size)]


def _stream(parser: ReplyParser, pieces: list[str]):
    deltas = [parser.feed(p) for p in pieces] + [parser.finish()]
    return deltas


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_tool_call_streams_content_then_holds_the_call(size):
    parser = ReplyParser(_markup(), tools=TOOLS)
    deltas = _stream(parser, _pieces("Sure." + CALL, size))
    assert "".join(d.content for d in deltas) == "Sure."
    assert all("<" not in d.content for d in deltas)  # no part of the start marker as content
    calls = [c for d in deltas for c in d.tool_calls]
    assert [c["function"] for c in calls] == [{"name": "get_weather", "arguments": '{"city": "Paris"}'}]
    assert calls[0]["type"] == "function" and calls[0]["id"].startswith("call_")
    assert json.loads(calls[0]["function"]["arguments"]) == {"city": "Paris"}
    # The call completes with the piece that finishes the end marker, not before.
    done = next(i for i, d in enumerate(deltas) if d.tool_calls)
    assert "".join(_pieces("Sure." + CALL, size)[:done + 1]).endswith("</tool_call>")
    assert parser.made_tool_call


@pytest.mark.parametrize("size", [1, 3, 1000])
def test_reasoning_goes_to_its_own_channel(size):
    deltas = _stream(ReplyParser(_markup()), _pieces("<think>plan</think>answer", size))
    assert "".join(d.reasoning for d in deltas) == "plan"
    assert "".join(d.content for d in deltas) == "answer"
    # The prompt opened the block: the reply starts inside it.
    opened = ReplyParser(_markup(), open_think_end="</think>")
    deltas = _stream(opened, _pieces("plan</think>answer", size))
    assert ("".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)) == ("plan", "answer")


def test_held_prefix_that_is_no_marker_comes_back_and_text_without_tools_is_content():
    parser = ReplyParser(_markup(), tools=TOOLS)
    assert parser.feed("a <tool").content == "a "
    assert parser.feed("box").content == "<toolbox"
    assert parser.feed("x <thi").content == "x "
    assert parser.finish().content == "<thi"
    # Without tools in the request, markup is plain text; reasoning then a call also works.
    delta, called = parse_reply(_markup(), "hi" + CALL)
    assert delta.content == "hi" + CALL and not called
    delta, called = parse_reply(_markup(), "<think>p</think>" + CALL + CALL, tools=TOOLS)
    assert (delta.reasoning, delta.content, len(delta.tool_calls), called) == ("p", "", 2, True)


def test_unparsable_or_cut_off_call_is_returned_as_text():
    delta, called = parse_reply(_markup(), "x<tool_call>{not json}</tool_call>", tools=TOOLS)
    assert delta.content == "x<tool_call>{not json}</tool_call>" and not called
    delta, called = parse_reply(_markup(), 'x<tool_call>{"name": "get_wea', tools=TOOLS)  # max_tokens hit
    assert delta.content == 'x<tool_call>{"name": "get_wea' and not called


def test_chat_replies_shapes():
    class Result:
        text = "Sure." + CALL

    replies = ChatReplies(_markup(), 1, TOOLS, None)
    message, reason = replies.message(0, Result(), "stop")
    assert reason == "tool_calls" and message["content"] == "Sure."
    assert message["tool_calls"][0]["function"]["name"] == "get_weather"
    only_call, reason = ChatReplies(_markup(), 1, TOOLS, None).message(0, type("R", (), {"text": CALL})(), "stop")
    assert only_call["content"] is None and reason == "tool_calls"
    streamed = ChatReplies(_markup(), 1, TOOLS, None)
    sent = [d for p in _pieces("<think>hm</think>Sure." + CALL + CALL, 4) for d in streamed.deltas(0, p, None)]
    assert streamed.deltas(0, "", "stop") == [{}]  # the finish reason still gets its chunk
    assert "".join(d.get("reasoning_content", "") for d in sent) == "hm"
    assert "".join(d.get("content", "") for d in sent) == "Sure."
    # Per call: a header (index, id, type, name, empty arguments), then its arguments.
    calls = [c for d in sent for c in d.get("tool_calls", [])]
    assert all(len(d["tool_calls"]) == 1 for d in sent if "tool_calls" in d)
    assert [(c["index"], c["type"], c["function"]) for c in calls[0::2]] == [
        (i, "function", {"name": "get_weather", "arguments": ""}) for i in (0, 1)]
    assert [c["id"].startswith("call_") for c in calls[0::2]] == [True, True]
    assert calls[1::2] == [{"index": i, "function": {"arguments": '{"city": "Paris"}'}} for i in (0, 1)]
    assert streamed.finish_reason(0, "stop") == "tool_calls" and streamed.finish_reason(0, "length") == "length"


@pytest.mark.parametrize("template, parser", [
    ("{{ '<tool_call>' }}{{ tool_call.name }}", "json_tools"),
    ("<tool_call>\n<function={{ name }}>", "qwen3_coder"),
    ("[TOOL_CALLS]", "mistral"),
    ("{{ messages[-1]['content'] }}", None),
])
def test_parser_choice_follows_the_chat_template(tmp_path, template, parser):
    from transformers import AutoTokenizer

    folder = with_chat_template(REPO / "models" / "adder", tmp_path / "adder", template)
    markup = load_markup(AutoTokenizer.from_pretrained(folder))
    assert (markup.tools.name if markup.tools else None) == parser
    assert markup.think[-1] == ("<think>", "</think>")


@pytest.fixture(scope="module")
def adder_gateway(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("tools")
    folder = with_chat_template(REPO / "models" / "adder", tmp / "adder", ADDER_TEMPLATE)
    port = _free_port()
    config = tmp / "tools.toml"
    config.write_text(f'[model]\npath = "{folder}"\n[server]\naddress = "ipc://"\n'
                      f'[scheduler]\nmax_context = 64\n[http]\naddress = "127.0.0.1:{port}"\n')
    with running_config(config, timeout=START_TIMEOUT_S) as svc:
        _wait_for_line(svc, "HTTP on")
        yield Gateway(svc, port, folder)


def test_tools_reach_the_template_and_a_reply_without_calls_is_content(adder_gateway):
    client = adder_gateway.openai()
    messages = [{"role": "user", "content": "123+456="}]
    plain = client.chat.completions.create(model="adder", messages=messages, max_tokens=8, temperature=0)
    assert plain.choices[0].message.content == "579" and plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.tool_calls is None
    for tool_choice in (None, "none", "auto"):  # the stream below compares with "auto"
        extra = {} if tool_choice is None else {"tool_choice": tool_choice}
        with_tools = client.chat.completions.create(model="adder", messages=messages, max_tokens=8, temperature=0,
                                                    tools=TOOLS, **extra)
        choice = with_tools.choices[0]
        # The template wrote "1\n" for the tool, except with "none": then it never saw it.
        assert with_tools.usage.prompt_tokens == plain.usage.prompt_tokens + (0 if tool_choice == "none" else 2)
        assert choice.finish_reason in ("stop", "length") and choice.message.tool_calls is None
        assert isinstance(choice.message.content, str)
    chunks = list(client.chat.completions.create(model="adder", messages=messages, max_tokens=8, temperature=0,
                                                 tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks) == with_tools.choices[0].message.content
    assert not any(c.choices[0].delta.tool_calls for c in chunks)
    assert [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason] == [choice.finish_reason]
    with pytest.raises(openai.BadRequestError):  # tools must still be objects
        client.chat.completions.create(model="adder", messages=messages, max_tokens=2, tools=["x"])
