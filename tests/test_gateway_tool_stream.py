"""Tool calls through the real gateway and the real `openai` package: streamed as `tool_calls`
deltas equal to the whole reply's calls, `tool_choice` forcing a call (or refused), and the
scheduler's queue time in /metrics.

Two services: the adder with four of its digit tokens renamed so that its sum spells text and
tool calls (`39+987=` -> `1026`), and the tiny llama (byte-level vocabulary), whose noise a
forced `tool_choice` turns into a valid call.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time

import httpx
import openai
import pytest
from conftest import REPO, running_config
from model_factory import with_chat_template
from test_gateway import START_TIMEOUT_S, Gateway, _free_port, _metric, _wait_for_line

from runtime.gateway import sse
from runtime.gateway.errors import ApiError
from runtime.gateway.tool_calls import ToolSyntax
from runtime.gateway.tool_choice import plan_tools
from runtime.scheduler.request import Request, SamplingParams

# A template that shows mlx-lm Qwen's JSON call syntax (it picks the json_tools parser).
TEMPLATE = ("{%- if tools %}{{ tools | length }} tools\n{% endif %}{{ messages[-1]['content'] }}"
            "{#- calls render as <tool_call>{\"name\": tool_call.name}</tool_call> #}")
PARIS = '{"name": "get_weather", "arguments": {"city": "Paris"}}'
ROME = '{"name": "get_weather", "arguments": {"city": "Rome"}}'
# "39+987=" -> "1026": content, a call whose start marker is split over two tokens, a call, content.
RENAMED = {"1": "Sure.<tool", "0": f"_call>\n{PARIS}\n</tool_call>", "2": f"<tool_call>\n{ROME}\n</tool_call>",
           "6": " Done."}
SUM = [{"role": "user", "content": "39+987="}]


def _tool(name: str, key: str, values: list[str]) -> dict:
    parameters = {"type": "object", "properties": {key: {"enum": values}}, "required": [key],
                  "additionalProperties": False}
    return {"type": "function", "function": {"name": name, "description": f"{name} tool", "parameters": parameters}}


WEATHER = _tool("get_weather", "city", ["Paris", "Rome"])
TIME = _tool("get_time", "zone", ["UTC", "CET"])


def _renamed_adder(folder):
    """The adder folder with template TEMPLATE (no tool count: digits 1, 0, 2, 6 are renamed)."""
    path = folder / "tokenizer.json"
    tok = json.loads(path.read_text())
    tok["model"]["vocab"] = {RENAMED.get(word, word): i for word, i in tok["model"]["vocab"].items()}
    path.write_text(json.dumps(tok))
    return folder


@pytest.fixture(scope="module")
def adder(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("renamed")
    folder = _renamed_adder(with_chat_template(REPO / "models" / "adder", tmp / "adder",
                                               TEMPLATE.replace("{{ tools | length }} tools\n", "")))
    yield from _serve(tmp, folder, 'max_context = 64')


@pytest.fixture(scope="module")
def llama(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("forced")
    folder = with_chat_template(model_dir("llama"), tmp / "llama", TEMPLATE)
    yield from _serve(tmp, folder, "max_context = 256\nmax_running = 1")  # one row: the second request waits


def _serve(tmp, folder, scheduler: str):
    port = _free_port()
    config = tmp / "service.toml"
    config.write_text(f'[model]\npath = "{folder}"\n[server]\naddress = "ipc://"\n[scheduler]\n{scheduler}\n'
                      f'[http]\naddress = "127.0.0.1:{port}"\n')
    with running_config(config, timeout=START_TIMEOUT_S) as svc:
        _wait_for_line(svc, "HTTP on")
        yield Gateway(svc, port, folder)


def _accumulate(chunks) -> tuple[str, list[dict], list[str | None], list[dict]]:
    """(content, tool calls, finish reasons, tool-call deltas) of a streamed chat reply, as a client sums them."""
    content, calls, finishes, tool_deltas = "", {}, [], []
    for chunk in chunks:
        for choice in chunk.choices:
            delta = choice.delta
            content += delta.content or ""
            for part in delta.tool_calls or []:
                tool_deltas.append(part.model_dump(exclude_none=True))
                call = calls.setdefault(part.index, {"id": None, "type": None, "name": "", "arguments": ""})
                call["id"] = call["id"] or part.id
                call["type"] = call["type"] or part.type
                if part.function is not None:
                    call["name"] += part.function.name or ""
                    call["arguments"] += part.function.arguments or ""
            finishes.append(choice.finish_reason)
    return content, [calls[i] for i in sorted(calls)], [f for f in finishes if f], tool_deltas


def _calls(message) -> list[dict]:
    return [{"id": c.id, "type": c.type, "name": c.function.name, "arguments": c.function.arguments}
            for c in message.tool_calls or []]


def _same_calls(streamed: list[dict], whole: list[dict]) -> None:
    assert [c["id"].startswith("call_") for c in streamed] == [True] * len(whole)
    assert [{k: v for k, v in c.items() if k != "id"} for c in streamed] == [
        {k: v for k, v in c.items() if k != "id"} for c in whole]


def test_streamed_tool_calls_are_deltas_equal_to_the_whole_reply(adder):
    client = adder.openai()
    kwargs = dict(model="adder", messages=SUM, tools=[WEATHER], max_tokens=8, temperature=0)
    whole = client.chat.completions.create(**kwargs).choices[0]
    assert whole.finish_reason == "tool_calls" and whole.message.content == "Sure. Done."
    calls = _calls(whole.message)
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [
        ("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Rome"})]

    chunks = list(client.chat.completions.create(stream=True, **kwargs))
    content, streamed, finishes, deltas = _accumulate(chunks)
    assert content == "Sure. Done." and finishes == ["tool_calls"]
    assert not any("tool" in (c.choices[0].delta.content or "") for c in chunks)  # no markup leaks as text
    _same_calls(streamed, calls)
    # Each call: a header with index, id, type and name, then its arguments as fragments.
    for index in (0, 1):
        mine = [d for d in deltas if d["index"] == index]
        assert set(mine[0]) == {"index", "id", "type", "function"} and mine[0]["function"]["name"] == "get_weather"
        assert not mine[0]["function"].get("arguments") and len(mine) >= 2
        assert all(set(d) == {"index", "function"} and set(d["function"]) == {"arguments"} for d in mine[1:])

    with client.chat.completions.stream(**kwargs) as helper:  # the SDK's own accumulator
        final = helper.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Sure. Done."
    _same_calls(_calls(final.message), calls)

    # "none": the calls are the reply's text, as the model wrote it.
    text = client.chat.completions.create(tool_choice="none", **kwargs).choices[0]
    assert text.message.tool_calls is None and text.finish_reason == "stop"
    assert text.message.content == "".join(RENAMED[d] for d in "1026")


async def test_async_streams_with_tool_calls(adder):
    client = adder.async_openai()
    try:
        async def one() -> tuple:
            stream = await client.chat.completions.create(model="adder", messages=SUM, tools=[WEATHER],
                                                          max_tokens=8, temperature=0, stream=True)
            return _accumulate([chunk async for chunk in stream])[:3]

        replies = await asyncio.wait_for(asyncio.gather(*(one() for _ in range(8))), 60)
    finally:
        await client.close()
    for content, calls, finishes in replies:
        assert (content, finishes, [c["arguments"] for c in calls]) == (
            "Sure. Done.", ["tool_calls"], ['{"city": "Paris"}', '{"city": "Rome"}'])


def test_forced_tool_choice_makes_a_valid_call(llama):
    client = llama.openai()
    name = llama.folder.name
    kwargs = dict(model=name, messages=[{"role": "user", "content": "what now?"}], tools=[WEATHER, TIME],
                  max_tokens=120, temperature=0)
    named = client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}},
                                           **kwargs).choices[0]
    assert named.finish_reason == "tool_calls" and named.message.content is None
    [call] = _calls(named.message)
    assert call["name"] == "get_time" and json.loads(call["arguments"])["zone"] in ("UTC", "CET")
    chunks = list(client.chat.completions.create(tool_choice={"type": "function", "function": {"name": "get_time"}},
                                                 stream=True, **kwargs))
    content, streamed, finishes, _ = _accumulate(chunks)
    assert content == "" and finishes == ["tool_calls"]
    _same_calls(streamed, [call])
    for seed in range(3):  # "required": one call of some tool, sampled
        required = client.chat.completions.create(**(kwargs | {"temperature": 1.0, "seed": seed}),
                                                  tool_choice="required").choices[0]
        [call] = _calls(required.message)
        args = json.loads(call["arguments"])
        assert args in ([{"city": c} for c in ("Paris", "Rome")] if call["name"] == "get_weather"
                        else [{"zone": z} for z in ("UTC", "CET")])


@pytest.mark.parametrize("tool_choice, tools, needle", [
    ({"type": "function", "function": {"name": "nope"}}, [WEATHER], "'nope'"),
    ("required", None, "at least one tool"),
    ("sometimes", [WEATHER], "tool_choice must be"),
    ({"type": "function"}, [WEATHER], "tool_choice must be"),
])
def test_bad_tool_choice_is_400(llama, tool_choice, tools, needle):
    with pytest.raises(openai.BadRequestError) as bad:
        llama.openai().chat.completions.create(model=llama.folder.name, messages=[{"role": "user", "content": "x"}],
                                               max_tokens=4, tools=tools, tool_choice=tool_choice)
    assert needle in bad.value.message and bad.value.param == "tool_choice"


def test_tool_choice_plans():
    forced = {"type": "function", "function": {"name": "get_time"}}
    json_tools = ToolSyntax("json_tools", "<tool_call>", "</tool_call>", lambda text, tools: None)
    assert plan_tools([WEATHER], "none", json_tools).tools is None
    assert plan_tools([WEATHER], "auto", None).grammar is None
    grammar = plan_tools([WEATHER, TIME], forced, json_tools).grammar
    assert grammar.startswith('start: "<tool_call>\\n" call') and '"get_time"' in grammar
    assert '"get_weather"' not in grammar
    for syntax, needle in ((ToolSyntax("mistral", "[TOOL_CALLS]", "", lambda t, s: None), "'mistral'"),
                           (None, "names no tool-call syntax")):
        with pytest.raises(ApiError) as refused:  # never silently ignored
            plan_tools([TIME], forced, syntax)
        assert refused.value.status == 400 and refused.value.param == "tool_choice" and needle in refused.value.message


def test_chunk_frames_match_the_objects():
    envelope = {"id": "x", "object": "chat.completion.chunk", "created": 1, "model": "m"}
    choice = {"index": 0, "delta": {"content": "é\n\"<"}, "logprobs": None, "finish_reason": None}
    for usage in (False, True):
        frames = sse.ChunkFrames(envelope, usage)
        frame = frames.chunk(choice)
        assert frame.startswith(b"data: ") and frame.endswith(b"\n\n")
        assert json.loads(frame[6:]) == envelope | {"choices": [choice]} | ({"usage": None} if usage else {})
    assert json.loads(frames.usage_chunk({"total_tokens": 3})[6:]) == envelope | {"choices": [],
                                                                                   "usage": {"total_tokens": 3}}


def test_streamed_n_equals_whole_n(llama):
    client = llama.openai()
    kwargs = dict(model=llama.folder.name, prompt="the", max_tokens=10, n=3, seed=5, temperature=1.0,
                  extra_body={"ignore_eos": True})
    whole = client.completions.create(**kwargs)
    texts = ["", "", ""]
    for chunk in client.completions.create(stream=True, **kwargs):
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [c.text for c in whole.choices]


def test_queue_time_is_the_wait_for_a_row(llama):
    """With one row, a request sent while another runs waits until that one ends."""
    def histogram() -> tuple[float, ...]:
        text = httpx.get(f"{llama.base}/metrics", timeout=10).text
        return tuple(_metric(text, f"runtime_{name}") for name in (
            "request_queue_time_seconds_count", "request_queue_time_seconds_sum",
            "time_to_first_token_seconds_sum", "e2e_request_latency_seconds_sum"))

    client = llama.openai()

    def one_wait() -> tuple[float, tuple[float, ...], tuple[float, ...]]:
        """(how long the second request's client saw the first one still running, the
        histograms before, after)."""
        before = histogram()
        long = client.completions.create(model=llama.folder.name, prompt="a", max_tokens=200, stream=True,
                                         temperature=0, extra_body={"ignore_eos": True})
        next(iter(long))  # the first request holds the row now
        done_at: list[float] = []

        def drain() -> None:
            for _ in long:
                pass
            done_at.append(time.monotonic())

        thread = threading.Thread(target=drain)
        thread.start()
        sent = time.monotonic()
        client.completions.create(model=llama.folder.name, prompt="b", max_tokens=2, temperature=0)
        thread.join(60)
        return done_at[0] - sent, before, histogram()

    # On a busy 2-CPU machine this client can be descheduled until the long request has all but
    # ended (5.8 ms once): then nothing waited, and the pair is sent again.
    for _ in range(3):
        waited, (count0, queue0, ttft0, e2e0), (count, queue, ttft, e2e) = one_wait()
        if waited > 0.05:
            break
    assert count == count0 + 2
    assert waited > 0.05, "the long request ended too soon to make the other one wait, three times"
    # ``waited`` is the client's view: its drain thread can lag the service by a good part of it
    # on a busy 2-CPU machine (0.24 s against a 0.10 s queue once); a queue time not counting
    # the wait for the row would read about 0.
    assert 0.25 * waited <= queue - queue0 <= e2e - e2e0
    # Admission comes before the first token (the prefill and a decode step lie between).
    assert queue - queue0 < ttft - ttft0


def test_admission_time_is_the_first_row():
    from runtime.scheduler.admission import Limits
    from runtime.scheduler.core import Scheduler

    s = Scheduler(Limits(64, 2, 32, 100), frozenset({0}), debug_invariants=True)
    req = Request(rid="r", prompt_ids=[1, 2], params=SamplingParams(), max_new=1)
    assert (req.row, req.admitted_at) == (-1, 0.0)
    s.add(req)
    s.next_step()  # admission gives the request its row: its time in the queue ends here
    assert req.row >= 0 and req.admitted_at > 0.0