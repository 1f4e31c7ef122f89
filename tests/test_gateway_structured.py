"""``response_format`` through the real gateway and the real ``openai`` package."""

from __future__ import annotations

import json

import openai
import pytest
from test_gateway import gateway_service

SCHEMA = {
    "type": "object",
    "properties": {"answer": {"enum": ["yes", "no"]}, "n": {"type": "integer", "minimum": 0, "maximum": 9}},
    "required": ["answer", "n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    with gateway_service(tmp_path_factory.mktemp("gateway-structured"), model_dir("llama")) as gw:
        yield gw


def test_json_schema_response_format_parses_streamed_or_not(gateway):
    client = gateway.openai()
    fmt = {"type": "json_schema", "json_schema": {"name": "reply", "schema": SCHEMA}}
    messages = [{"role": "user", "content": "yes or no?"}]
    for seed in range(4):
        r = client.chat.completions.create(model=gateway.folder.name, messages=messages, max_tokens=60,
                                           temperature=1.0, seed=seed, response_format=fmt)
        value = json.loads(r.choices[0].message.content)
        assert value["answer"] in ("yes", "no") and 0 <= value["n"] <= 9 and r.choices[0].finish_reason == "stop"
    chunks = client.chat.completions.create(model=gateway.folder.name, messages=messages, max_tokens=60,
                                            temperature=0, response_format=fmt, stream=True)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert set(json.loads(text)) == {"answer", "n"}
    done = client.completions.create(model=gateway.folder.name, prompt="x", max_tokens=60, temperature=0,
                                     extra_body={"response_format": fmt})
    assert set(json.loads(done.choices[0].text)) == {"answer", "n"}


def test_json_object_and_bad_formats(gateway):
    client = gateway.openai()
    messages = [{"role": "user", "content": "json please"}]
    r = client.chat.completions.create(model=gateway.folder.name, messages=messages, max_tokens=150, temperature=0,
                                       response_format={"type": "json_object"})
    if r.choices[0].finish_reason == "stop":  # else it ran out of max_tokens mid-object
        assert isinstance(json.loads(r.choices[0].message.content), dict)
    for bad in ({"type": "xml"}, {"type": "json_schema", "json_schema": {"name": "x"}},
                {"type": "json_schema", "json_schema": {"schema": {"type": "object", "properties": 3}}}):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=gateway.folder.name, messages=messages, max_tokens=5,
                                           response_format=bad)
        assert "response_format" in str(err.value) or "json_schema" in str(err.value)
