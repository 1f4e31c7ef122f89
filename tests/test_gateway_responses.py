"""``POST /v1/responses`` (OpenAI's Responses API) through the real gateway and the real `openai`
package: the same reply as the chat route, split into output items (text, function calls) in
the order the model wrote them, streamed as OpenAI's typed events, and refusals as 400s.

Services from ``test_gateway_tool_stream``: the renamed adder, whose greedy reply to `39+987=`
is text, two tool calls and text; the tiny llama, whose calls a forced `tool_choice` makes.
"""

from __future__ import annotations

import json

import openai
import pytest
from conftest import REPO
from model_factory import with_chat_template
from test_gateway_tool_stream import (  # noqa: F401 (adder, llama: fixtures)
    PARIS,
    RENAMED,
    SUM,
    TEMPLATE,
    TIME,
    WEATHER,
    _serve,
    adder,
    llama,
)

from runtime.gateway.errors import ApiError
from runtime.gateway.responses_input import chat_messages, chat_tool_choice, chat_tools, response_format


def _flat(tool: dict) -> dict:
    """A chat tool as the Responses API writes it."""
    return {"type": "function", **tool["function"]}


def _shape(items) -> list[tuple]:
    """Output items without their random ids: (type, text or (name, arguments))."""
    out = []
    for item in items:
        item = item if isinstance(item, dict) else item.model_dump()
        if item["type"] == "message":
            assert [p["type"] for p in item["content"]] == ["output_text"]
            out.append(("message", item["content"][0]["text"]))
        elif item["type"] == "function_call":
            assert item["call_id"].startswith("call_") and item["id"].startswith("fc_")
            out.append(("function_call", item["name"], json.loads(item["arguments"])))
        else:
            out.append((item["type"],))
    return out


WRITTEN = [("message", "Sure."), ("function_call", "get_weather", {"city": "Paris"}),
           ("function_call", "get_weather", {"city": "Rome"}), ("message", " Done.")]


def test_text_and_usage_equal_the_chat_routes(adder):
    client = adder.openai()
    chat = client.chat.completions.create(model="adder", messages=SUM, max_tokens=8, temperature=0)
    response = client.responses.create(model="adder", input="39+987=", instructions="add", max_output_tokens=8,
                                       temperature=0)
    assert response.object == "response" and response.status == "completed" and response.id.startswith("resp_")
    assert response.output_text == chat.choices[0].message.content == "".join(RENAMED[d] for d in "1026")
    assert (response.usage.input_tokens, response.usage.output_tokens) == (chat.usage.prompt_tokens,
                                                                           chat.usage.completion_tokens)
    assert response.usage.total_tokens == chat.usage.total_tokens and response.instructions == "add"


def test_tool_calls_become_items_in_the_order_written_whole_and_streamed(adder):
    client = adder.openai()
    kwargs = dict(model="adder", input=[{"role": "user", "content": "39+987="}], tools=[_flat(WEATHER)],
                  max_output_tokens=8, temperature=0)
    whole = client.responses.create(**kwargs)
    assert whole.status == "completed" and _shape(whole.output) == WRITTEN

    events = list(client.responses.create(stream=True, **kwargs))
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert [e.type for e in events[:2]] == ["response.created", "response.in_progress"]
    assert events[-1].type == "response.completed" and _shape(events[-1].response.output) == WRITTEN
    text = {}
    for e in events:
        if e.type == "response.output_text.delta":
            text[e.output_index] = text.get(e.output_index, "") + e.delta
    assert text == {0: "Sure.", 3: " Done."}
    added = [e.item.type for e in events if e.type == "response.output_item.added"]
    done = [e.item.type for e in events if e.type == "response.output_item.done"]
    assert added == done == ["message", "function_call", "function_call", "message"]
    arguments = [json.loads(e.arguments) for e in events if e.type == "response.function_call_arguments.done"]
    assert arguments == [{"city": "Paris"}, {"city": "Rome"}]

    with client.responses.stream(**kwargs) as helper:  # the SDK's own accumulator of the events
        final = helper.get_final_response()
    assert _shape(final.output) == WRITTEN and final.output_text == "Sure. Done."


# "567+667=" -> "1234": reasoning, text, a call, text.
THINKING = {"1": "<think>hm</think>Sure.", "2": f"<tool_call>\n{PARIS}\n</tool_call>", "3": " Done", "4": "!"}


@pytest.fixture(scope="module")
def thinking_adder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("thinking")
    folder = with_chat_template(REPO / "models" / "adder", tmp / "adder",
                                TEMPLATE.replace("{{ tools | length }} tools\n", ""))
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["model"]["vocab"] = {THINKING.get(word, word): i for word, i in tok["model"]["vocab"].items()}
    path.write_text(json.dumps(tok))
    yield from _serve(tmp, folder, "max_context = 64")


def test_reasoning_is_an_item_of_its_own_through_the_sdk(thinking_adder):
    client = thinking_adder.openai()
    kwargs = dict(model="adder", input="567+667=", tools=[_flat(WEATHER)], max_output_tokens=8, temperature=0)
    written = [("reasoning",), ("message", "Sure."), ("function_call", "get_weather", {"city": "Paris"}),
               ("message", " Done!")]
    whole = client.responses.create(**kwargs)
    assert _shape(whole.output) == written
    assert whole.output[0].content[0].text == "hm" and whole.output[0].content[0].type == "reasoning_text"
    with client.responses.stream(**kwargs) as helper:
        events = list(helper)
        final = helper.get_final_response()
    assert _shape(final.output) == written and final.output[0].content[0].text == "hm"
    assert "".join(e.delta for e in events if e.type == "response.reasoning_text.delta") == "hm"


def test_max_output_tokens_makes_an_incomplete_response(adder):
    client = adder.openai()
    cut = client.responses.create(model="adder", input="39+987=", max_output_tokens=2, temperature=0)
    assert cut.status == "incomplete" and cut.incomplete_details.reason == "max_output_tokens"
    assert cut.output_text == RENAMED["1"] + RENAMED["0"] and cut.usage.output_tokens == 2
    events = list(client.responses.create(model="adder", input="39+987=", max_output_tokens=2, temperature=0,
                                          stream=True))
    assert events[-1].type == "response.incomplete" and events[-1].response.output_text == cut.output_text


def test_a_conversation_with_calls_and_their_outputs_runs_as_its_chat(llama):
    client = llama.openai()
    name = llama.folder.name
    items = [{"role": "user", "content": "weather?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Rome"}'},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "and "},
                                                             {"type": "input_text", "text": "tomorrow?"}]}]
    response = client.responses.create(model=name, input=items, tools=[_flat(WEATHER)], max_output_tokens=12,
                                       temperature=0)
    chat = client.chat.completions.create(model=name, messages=chat_messages(None, items), tools=[WEATHER],
                                          max_tokens=12, temperature=0)
    assert response.output_text == (chat.choices[0].message.content or "")
    assert response.usage.input_tokens == chat.usage.prompt_tokens


def test_forced_tool_choice_and_structured_text(llama):
    client = llama.openai()
    name = llama.folder.name
    forced = client.responses.create(model=name, input="what now?", tools=[_flat(WEATHER), _flat(TIME)],
                                     tool_choice={"type": "function", "name": "get_time"}, max_output_tokens=120,
                                     temperature=0)
    [call] = _shape(forced.output)
    assert call[:2] == ("function_call", "get_time") and call[2]["zone"] in ("UTC", "CET")
    answer = client.responses.create(model=name, input="yes or no?", max_output_tokens=20, temperature=0, text={
        "format": {"type": "json_schema", "name": "answer", "schema": {"enum": ["yes", "no"]}}})
    assert json.loads(answer.output_text) in ("yes", "no")


@pytest.mark.parametrize("extra, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search"}]}, "tools[0]"),
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input[0].content[0]"),
    ({"input": [{"type": "item_reference", "id": "x"}]}, "input[0].type"),
    ({"input": [{"role": "tool", "content": "x"}]}, "input[0].role"),
    ({"input": []}, "input"),
])
def test_what_it_cannot_do_is_400(adder, extra, param):
    with pytest.raises(openai.BadRequestError) as bad:
        adder.openai().responses.create(**({"model": "adder", "input": "1+1=", "max_output_tokens": 2} | extra))
    assert bad.value.param == param
    with pytest.raises(openai.NotFoundError):
        adder.openai().responses.create(model="nope", input="1+1=", max_output_tokens=2)


def test_the_input_conversion():
    items = [{"role": "developer", "content": "be brief"},
             {"role": "user", "content": [{"type": "input_text", "text": "hi"}]},
             {"role": "assistant", "content": [{"type": "output_text", "text": "let me look"}]},
             {"type": "function_call", "call_id": "c1", "name": "f", "arguments": "{}"},
             {"type": "function_call", "call_id": "c2", "name": "g", "arguments": "{\"a\": 1}"},
             {"type": "reasoning", "id": "rs_1", "summary": []},
             {"type": "function_call_output", "call_id": "c1", "output": "one"},
             {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
             {"type": "function_call", "call_id": "c3", "name": "f", "arguments": "{}"}]
    assert chat_messages("rules", items) == [
        {"role": "system", "content": "rules"},
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{\"a\": 1}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "assistant", "content": "", "tool_calls": [
            {"id": "c3", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
    ]
    assert chat_messages(None, "hello") == [{"role": "user", "content": "hello"}]
    assert chat_tools([{"type": "function", "name": "f", "parameters": {"type": "object"}, "strict": True}]) == [
        {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}]
    assert chat_tool_choice({"type": "function", "name": "f"}) == {"type": "function", "function": {"name": "f"}}
    assert chat_tool_choice("required") == "required"
    assert response_format({"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}) == {
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}}
    assert response_format(None) is None and response_format({"format": {"type": "text"}}) == {"type": "text"}
    with pytest.raises(ApiError) as bad:
        chat_messages(None, [{"type": "function_call", "call_id": "c", "name": "f"}])
    assert bad.value.param == "input[0].arguments"


def test_the_parsers_parts_keep_the_order_written_inside_one_piece():
    from test_gateway_tools import CALL, _markup

    from runtime.gateway.reply_parser import ReplyParser
    from runtime.gateway.responses import OutputItems

    parser = ReplyParser(_markup(), tools=[WEATHER])
    delta = parser.feed("<think>hm</think>Sure." + CALL + " Done.")
    delta.add(parser.finish())
    assert [(kind, value if kind != "tool" else value["function"]["name"]) for kind, value in delta.parts] == [
        ("reasoning", "hm"), ("content", "Sure."), ("tool", "get_weather"), ("content", " Done.")]
    items = OutputItems()
    events = items.feed(delta) + items.close()
    assert [i["type"] for i in items.items] == ["reasoning", "message", "function_call", "message"]
    assert items.items[0]["content"] == [{"type": "reasoning_text", "text": "hm"}]
    assert [e["type"] for e in events].count("response.output_item.done") == 4
