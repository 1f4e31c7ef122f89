"""Chat messages to prompt token ids through the model folder's chat template (no mlx)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping
from typing import Any

from runtime.scheduler.admission import RequestRejected

# Template variables that chat_template_kwargs may set even though apply_chat_template names them.
_PASSED_THROUGH = frozenset({"documents"})


def chat_prompt_ids(
    hf_tokenizer: Any,
    messages: list[dict],
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> list[int]:
    """Render `messages` with the chat template (add_generation_prompt=True) and tokenize them.

    `hf_tokenizer` is a transformers tokenizer. `chat_template_kwargs` become template
    variables (e.g. enable_thinking); they may not override apply_chat_template's own
    arguments (tokenize, return_dict, chat_template, ...). Raises RequestRejected for bad
    messages, a folder without a chat template, or a template that fails.
    """
    check_messages(messages)
    extra = _template_kwargs(hf_tokenizer, chat_template_kwargs)
    if tools is not None and (
        not isinstance(tools, list) or not all(isinstance(tool, dict) for tool in tools)
    ):
        raise RequestRejected("tools must be a list of objects")
    if not getattr(hf_tokenizer, "chat_template", None):
        raise RequestRejected("this model folder has no chat template: send a plain prompt instead")
    try:
        rendered = hf_tokenizer.apply_chat_template(
            messages,
            tools=tools,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
            **extra,
        )
    except Exception as exc:  # a template's error is this request's problem, not the service's
        raise RequestRejected(f"the chat template failed: {type(exc).__name__}: {exc}") from exc
    if isinstance(rendered, Mapping):  # some tokenizers return a BatchEncoding regardless
        rendered = rendered["input_ids"]
    ids = list(rendered)
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise RequestRejected("the chat template did not produce a flat list of token ids")
    return ids


def system_prefix_len(
    hf_tokenizer: Any,
    messages: list[dict],
    ids: list[int],
    chat_template_kwargs: dict | None = None,
    tools: list[dict] | None = None,
) -> int:
    """How many of ``ids`` (the whole conversation, as ``chat_prompt_ids`` rendered it) are its
    leading system message as the template renders it alone: the part other conversations with
    that system message share. 0 where there is none, or the template will not render it alone
    (a hint for the prefix cache only: never wrong tokens)."""
    if len(messages) < 2 or messages[0].get("role") not in ("system", "developer"):
        return 0
    try:
        alone = hf_tokenizer.apply_chat_template(
            messages[:1], tools=tools, add_generation_prompt=False, tokenize=True, return_dict=False,
            **_template_kwargs(hf_tokenizer, chat_template_kwargs),
        )
    except Exception:  # noqa: BLE001 - a template that needs a user turn: no hint
        return 0
    if isinstance(alone, Mapping):
        alone = alone["input_ids"]
    n = 0
    for a, b in zip(alone, ids):
        if a != b:
            break
        n += 1
    return n


def check_messages(messages: Any) -> None:
    """A non-empty list of dicts, each with a string "role"; content a string, None or parts."""
    if not isinstance(messages, list) or not messages:
        raise RequestRejected("messages must be a non-empty list of message objects")
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise RequestRejected(f"messages[{i}] must be an object with a 'role', got {type(message).__name__}")
        if not isinstance(message.get("role"), str):
            raise RequestRejected(f"messages[{i}] must have a string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise RequestRejected(
                f"messages[{i}].content must be a string, null or a list of parts, got {type(content).__name__}"
            )


def _template_kwargs(hf_tokenizer: Any, chat_template_kwargs: Any) -> dict[str, Any]:
    """The extra template variables, refusing names that would change apply_chat_template itself."""
    if chat_template_kwargs is None:
        return {}
    if not isinstance(chat_template_kwargs, dict) or not all(isinstance(k, str) for k in chat_template_kwargs):
        raise RequestRejected("chat_template_kwargs must be an object with string keys")
    reserved = _apply_arguments(hf_tokenizer) - _PASSED_THROUGH
    clashes = sorted(k for k in chat_template_kwargs if k in reserved)
    if clashes:
        raise RequestRejected(
            f"chat_template_kwargs may only set template variables; {', '.join(clashes)} "
            f"{'is an argument' if len(clashes) == 1 else 'are arguments'} of apply_chat_template"
        )
    return dict(chat_template_kwargs)


def _apply_arguments(hf_tokenizer: Any) -> frozenset[str]:
    """The named parameters of this tokenizer's apply_chat_template (they vary by version)."""
    names = {"conversation", "tools", "add_generation_prompt", "tokenize", "return_dict", "chat_template"}
    try:
        parameters = inspect.signature(hf_tokenizer.apply_chat_template).parameters.values()
    except (AttributeError, TypeError, ValueError):
        return frozenset(names)
    names |= {p.name for p in parameters if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)}
    return frozenset(names)
