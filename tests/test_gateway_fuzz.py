"""Any body a client posts to the HTTP gateway gets one answer, never a server error, and the
service keeps serving (SPEC 8.1, over HTTP).

A bounded hypothesis fuzz of OpenAI request bodies (the API's own field names with values of
every JSON type, nested and out of range, on the completions, chat and responses routes, streamed
or not)
and of raw bytes, against the real `runtime up` with [http]. Each reply must be a 2xx with a
whole body (a stream ends with ``data: [DONE]``, or a Responses stream with its closing event) or a 4xx with OpenAI's error object; after each,
``/health`` must answer 200.
"""

from __future__ import annotations

import json

import httpx
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_gateway import gateway_service

FUZZ_EXAMPLES = 300
TIMEOUT_S = 60.0

COMPLETION_FIELDS = [
    "model", "prompt", "max_tokens", "temperature", "top_p", "n", "stream", "stream_options", "logprobs",
    "echo", "stop", "presence_penalty", "frequency_penalty", "best_of", "logit_bias", "user", "suffix", "seed",
    "top_k", "min_p", "repetition_penalty", "min_tokens", "stop_token_ids", "ignore_eos", "response_format",
]
CHAT_FIELDS = [
    "model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stream",
    "stream_options", "logprobs", "top_logprobs", "stop", "presence_penalty", "frequency_penalty", "logit_bias",
    "seed", "tools", "tool_choice", "response_format", "parallel_tool_calls", "chat_template_kwargs", "top_k",
    "min_p", "min_tokens", "reasoning_effort",
]

RESPONSES_FIELDS = [
    "model", "input", "instructions", "max_output_tokens", "temperature", "top_p", "stream", "tools", "tool_choice",
    "parallel_tool_calls", "text", "previous_response_id", "metadata", "store", "reasoning", "seed", "top_k",
]

scalar_st = st.one_of(
    st.none(), st.booleans(),
    st.integers(-(2**70), 2**70), st.sampled_from([0, 1, 2, 3, -1, 16, 255, 256, 10**9]),
    st.floats(allow_nan=False, allow_infinity=False), st.sampled_from([0.0, 0.5, 1.0, 2.0, -0.5, 1e308]),
    st.text(max_size=12), st.sampled_from(["", "hi", "auto", "none", "required", "json_object", "\x00", "\ud7ff"]),
)
json_st = st.recursive(scalar_st, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=8), inner, max_size=4)), max_leaves=12)

# Mostly values a client would send (so a body gets past its first check and runs), now and
# then any JSON at all in their place.
message_st = st.fixed_dictionaries(
    {"role": st.sampled_from(["system", "user", "user", "assistant", "tool", "nobody"])},
    optional={"content": st.one_of(st.text(max_size=20), st.text(max_size=20), json_st), "name": st.text(max_size=6),
              "tool_call_id": st.text(max_size=6)})
tool_st = st.fixed_dictionaries({"type": st.just("function"), "function": st.fixed_dictionaries(
    {"name": st.text(st.characters(min_codepoint=97, max_codepoint=122), min_size=1, max_size=8)},
    optional={"parameters": st.one_of(st.just({"type": "object", "properties": {"x": {"type": "integer"}}}), json_st),
              "description": st.text(max_size=10)})})
schema_st = st.sampled_from([{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]},
                             {"type": "string", "maxLength": 3}, {"enum": ["yes", "no"]}, {"type": "array"}])
VALID = {
    "prompt": st.one_of(st.text(max_size=30), st.lists(st.integers(0, 300), min_size=1, max_size=20),
                        st.lists(st.text(min_size=1, max_size=10), min_size=1, max_size=2)),
    "messages": st.lists(message_st, min_size=1, max_size=4),
    "max_tokens": st.integers(1, 6), "max_completion_tokens": st.integers(1, 6),
    "temperature": st.floats(0, 2), "top_p": st.floats(0.01, 1), "n": st.integers(1, 3), "best_of": st.integers(1, 3),
    "stream": st.booleans(), "stream_options": st.fixed_dictionaries({"include_usage": st.booleans()}),
    "logprobs": st.one_of(st.booleans(), st.integers(0, 5)), "top_logprobs": st.integers(0, 5), "echo": st.booleans(),
    "stop": st.one_of(st.text(min_size=1, max_size=3), st.lists(st.text(min_size=1, max_size=3), max_size=4)),
    "presence_penalty": st.floats(-2, 2), "frequency_penalty": st.floats(-2, 2),
    "logit_bias": st.dictionaries(st.integers(0, 300).map(str), st.floats(-100, 100), max_size=3),
    "seed": st.integers(0, 2**31), "top_k": st.integers(-1, 50), "min_p": st.floats(0, 1),
    "repetition_penalty": st.floats(0.5, 2), "min_tokens": st.integers(0, 4),
    "stop_token_ids": st.lists(st.integers(0, 300), max_size=3), "ignore_eos": st.booleans(),
    "response_format": st.one_of(st.just({"type": "json_object"}), st.just({"type": "text"}),
                                 st.fixed_dictionaries({"type": st.just("json_schema"), "json_schema": st.fixed_dictionaries(
                                     {"name": st.just("x"), "schema": schema_st})})),
    "tools": st.lists(tool_st, min_size=1, max_size=2),
    "tool_choice": st.one_of(st.sampled_from(["auto", "none", "required"]), st.fixed_dictionaries(
        {"type": st.just("function"), "function": st.fixed_dictionaries({"name": st.text(max_size=8)})})),
    "parallel_tool_calls": st.booleans(), "chat_template_kwargs": st.dictionaries(st.text(max_size=8), json_st, max_size=2),
    "suffix": st.text(max_size=5), "user": st.text(max_size=5), "reasoning_effort": st.sampled_from(["low", "high"]),
    # the Responses API's own
    "input": st.one_of(st.text(max_size=20), st.lists(st.one_of(
        message_st, st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=4),
                                           "name": st.text(max_size=4), "arguments": st.just("{}")}),
        st.fixed_dictionaries({"type": st.just("function_call_output"), "call_id": st.text(max_size=4),
                               "output": st.text(max_size=8)})), min_size=1, max_size=4)),
    "instructions": st.text(max_size=10), "max_output_tokens": st.integers(1, 6),
    "text": st.fixed_dictionaries({"format": st.one_of(st.just({"type": "text"}), st.just({"type": "json_object"}),
                                                       st.fixed_dictionaries({"type": st.just("json_schema"),
                                                                              "name": st.just("x"),
                                                                              "schema": schema_st}))}),
    "metadata": st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=2),
}


def field_st(name: str, model: str):
    valid = st.just(model) if name == "model" else VALID.get(name)
    return json_st if valid is None else st.one_of(*[valid] * 5, json_st)


def body_st(base: dict, fields: list[str]):
    return st.lists(st.sampled_from(fields), unique=True, max_size=6).flatmap(
        lambda keys: st.fixed_dictionaries({k: field_st(k, base["model"]) for k in keys})).map(
        lambda over: {**base, **over})


def request_st(model: str):
    return st.one_of(
        st.tuples(st.just("/v1/completions"),
                  body_st({"model": model, "prompt": "hi there", "max_tokens": 4}, COMPLETION_FIELDS)),
        st.tuples(st.just("/v1/chat/completions"),
                  body_st({"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
                          CHAT_FIELDS)),
        st.tuples(st.just("/v1/responses"),
                  body_st({"model": model, "input": "hi", "max_output_tokens": 4}, RESPONSES_FIELDS)),
    )


def _check_reply(reply: httpx.Response, what: str) -> None:
    status = reply.status_code
    assert status < 500, f"{what} -> {status}: {reply.text[:500]}"
    if status >= 400:
        error = reply.json()["error"]
        assert {"message", "type"} <= set(error), f"{what} -> {status}: {reply.text[:500]}"
    elif reply.headers.get("content-type", "").startswith("text/event-stream"):
        last = reply.text.rstrip().rsplit("\n", 1)[-1]
        if "/v1/responses" in what:  # typed events; the last one ends the response
            assert json.loads(last.removeprefix("data: "))["type"] in (
                "response.completed", "response.incomplete", "response.failed"), f"{what}: {reply.text[-300:]}"
        else:
            assert last == "data: [DONE]", f"{what}: a stream ended without [DONE]: {reply.text[-300:]}"
    else:
        reply.json()


def test_any_body_gets_one_answer_and_the_service_keeps_serving(model_dir, tmp_path_factory):
    with gateway_service(tmp_path_factory.mktemp("gateway-fuzz"), model_dir("llama")) as gw, \
            httpx.Client(base_url=gw.base, timeout=TIMEOUT_S) as http:

        @settings(max_examples=FUZZ_EXAMPLES, deadline=None, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
        @given(request_st(gw.folder.name))
        def post(request):
            route, body = request
            what = f"POST {route} {json.dumps(body)[:400]}"
            _check_reply(http.post(route, json=body), what)
            assert http.get("/health").status_code == 200, f"not serving after {what}\n{gw.svc.log()}"

        post()

        for raw in (b"", b"{", b"[]", b"null", b"1e999", b'{"prompt": "\xff\xfe"}', b'"' + b"a" * 100_000 + b'"',
                    b"[" * 10_000 + b"]" * 10_000):
            for route in ("/v1/completions", "/v1/chat/completions", "/v1/responses"):
                reply = http.post(route, content=raw, headers={"content-type": "application/json"})
                _check_reply(reply, f"POST {route} raw {raw[:40]!r}")
        assert http.get("/health").status_code == 200, gw.svc.log()
