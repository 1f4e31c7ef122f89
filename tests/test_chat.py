"""chat_prompt_ids: the folder's chat template, add_generation_prompt=True, clear refusals."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from runtime.scheduler.admission import RequestRejected
from runtime.scheduler.chat import chat_prompt_ids
from runtime.scheduler.tokenizer import Tokenizer

CONVERSATIONS = [
    [{"role": "user", "content": "hello there"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "the cat sat"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "a question"},
        {"role": "assistant", "content": "an answer"},
        {"role": "user", "content": "another question"},
    ],
]

# Uses an extra variable, tools and raise_exception, so each path is observable in the ids.
CUSTOM_TEMPLATE = (
    "{% if greeting is defined %}{{ greeting }}\n{% endif %}"
    "{% if tools %}tools: {{ tools | map(attribute='name') | join(', ') }}\n{% endif %}"
    "{% for message in messages %}"
    "{% if message['role'] == 'forbidden' %}{{ raise_exception('role forbidden is not allowed') }}{% endif %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def tok(model_dir):
    return Tokenizer(str(model_dir("llama")))._tok


def _copy_with_template(src: Path, dst: Path, template: str | None) -> Path:
    """A copy of the model folder whose tokenizer_config has `template` (None: no template)."""
    shutil.copytree(src, dst)
    for name in ("chat_template.jinja", "chat_template.json"):
        (dst / name).unlink(missing_ok=True)
    config_file = dst / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("chat_template", None)
    if template is not None:
        config["chat_template"] = template
    config_file.write_text(json.dumps(config))
    return dst


@pytest.fixture(scope="module")
def custom_tok(model_dir, tmp_path_factory):
    folder = _copy_with_template(model_dir("llama"), tmp_path_factory.mktemp("chat") / "custom", CUSTOM_TEMPLATE)
    return Tokenizer(str(folder))._tok


@pytest.mark.parametrize("messages", CONVERSATIONS)
def test_matches_apply_chat_template(tok, messages):
    ids = chat_prompt_ids(tok, messages)
    want = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    assert ids == list(want)
    assert all(type(t) is int for t in ids)
    text = tok.decode(ids)
    assert text.endswith("assistant:")
    assert text == "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"


def test_content_none_and_parts_pass_through(tok):
    messages = [{"role": "user", "content": None}, {"role": "user"}]
    ids = chat_prompt_ids(tok, messages)
    assert ids == list(tok.apply_chat_template(messages, add_generation_prompt=True, return_dict=False))
    assert tok.decode(ids) == "user: \nuser: \nassistant:"
    parts = [{"type": "text", "text": "hi"}]
    assert chat_prompt_ids(tok, [{"role": "user", "content": parts}]) == list(
        tok.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True, return_dict=False)
    )


def test_chat_template_kwargs_reach_the_template(custom_tok):
    messages = CONVERSATIONS[0]
    plain = chat_prompt_ids(custom_tok, messages)
    greeted = chat_prompt_ids(custom_tok, messages, chat_template_kwargs={"greeting": "howdy"})
    assert custom_tok.decode(plain) == "user: hello there\nassistant:"
    assert custom_tok.decode(greeted) == "howdy\nuser: hello there\nassistant:"
    assert chat_prompt_ids(custom_tok, messages, chat_template_kwargs={}) == plain


def test_unused_kwargs_are_harmless(tok):
    messages = CONVERSATIONS[1]
    assert chat_prompt_ids(tok, messages, chat_template_kwargs={"enable_thinking": False}) == chat_prompt_ids(
        tok, messages
    )


def test_tools_reach_the_template(custom_tok):
    tools = [{"name": "search", "parameters": {}}, {"name": "calc"}]
    ids = chat_prompt_ids(custom_tok, CONVERSATIONS[0], tools=tools)
    assert custom_tok.decode(ids) == "tools: search, calc\nuser: hello there\nassistant:"


def test_template_error_is_a_rejection(custom_tok):
    with pytest.raises(RequestRejected, match="the chat template failed: .*role forbidden is not allowed"):
        chat_prompt_ids(custom_tok, [{"role": "forbidden", "content": "x"}])


def test_folder_without_chat_template(model_dir, tmp_path):
    folder = _copy_with_template(model_dir("llama"), tmp_path / "plain", None)
    bare = Tokenizer(str(folder))._tok
    assert not bare.chat_template
    with pytest.raises(RequestRejected, match="this model folder has no chat template"):
        chat_prompt_ids(bare, CONVERSATIONS[0])


@pytest.mark.parametrize(
    ("messages", "message"),
    [
        ([], "messages must be a non-empty list"),
        (None, "messages must be a non-empty list"),
        ("hello", "messages must be a non-empty list"),
        ({"role": "user", "content": "x"}, "messages must be a non-empty list"),
        (["hello"], r"messages\[0\] must be an object with a 'role', got str"),
        ([{"role": "user", "content": "x"}, {"content": "y"}], r"messages\[1\] must have a string 'role'"),
        ([{"role": 3, "content": "x"}], r"messages\[0\] must have a string 'role'"),
        ([{"role": "user", "content": 5}], r"messages\[0\].content must be a string, null or a list of parts"),
        ([{"role": "user", "content": {"a": 1}}], r"messages\[0\].content must be a string, null or a list"),
    ],
)
def test_bad_messages_are_refused(tok, messages, message):
    with pytest.raises(RequestRejected, match=message):
        chat_prompt_ids(tok, messages)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"tokenize": False}, "tokenize is an argument of apply_chat_template"),
        ({"return_dict": True, "chat_template": "x"}, "chat_template, return_dict are arguments"),
        ({"add_generation_prompt": False}, "add_generation_prompt is an argument"),
        ({"return_tensors": "np"}, "return_tensors is an argument"),
        ([("a", 1)], "chat_template_kwargs must be an object with string keys"),
        ({1: "x"}, "chat_template_kwargs must be an object with string keys"),
    ],
)
def test_bad_chat_template_kwargs_are_refused(tok, kwargs, message):
    with pytest.raises(RequestRejected, match=message):
        chat_prompt_ids(tok, CONVERSATIONS[0], chat_template_kwargs=kwargs)


@pytest.mark.parametrize("tools", [{"name": "x"}, ["x"], "search"])
def test_bad_tools_are_refused(tok, tools):
    with pytest.raises(RequestRejected, match="tools must be a list of objects"):
        chat_prompt_ids(tok, CONVERSATIONS[0], tools=tools)


def test_the_system_part_of_a_conversation_is_measured_in_its_own_tokens(tok, custom_tok, tmp_path, model_dir):
    from runtime.scheduler.chat import system_prefix_len

    conversation = CONVERSATIONS[2]
    ids = chat_prompt_ids(tok, conversation)
    n = system_prefix_len(tok, conversation, ids)
    alone = tok.apply_chat_template(conversation[:1], add_generation_prompt=False, tokenize=True, return_dict=False)
    assert 0 < n == len(alone) < len(ids) and ids[:n] == list(alone)
    # Tools render in the system part here: it still matches.
    tools = [{"name": "lookup", "description": "find", "parameters": {"type": "object"}}]
    with_tools = chat_prompt_ids(custom_tok, conversation, tools=tools)
    assert system_prefix_len(custom_tok, conversation, with_tools, tools=tools) > n
    # No system message, or nothing after it: no hint.
    assert system_prefix_len(tok, CONVERSATIONS[0], chat_prompt_ids(tok, CONVERSATIONS[0])) == 0
    assert system_prefix_len(tok, conversation[:1], chat_prompt_ids(tok, conversation[:1])) == 0
    # A template that will not render a system message alone: no hint, no error.
    picky = _copy_with_template(model_dir("llama"), tmp_path / "picky",
                                "{% if messages | length < 2 %}{{ raise_exception('no user turn') }}{% endif %}"
                                + CUSTOM_TEMPLATE)
    picky_tok = Tokenizer(str(picky))._tok
    assert system_prefix_len(picky_tok, conversation, chat_prompt_ids(picky_tok, conversation)) == 0
