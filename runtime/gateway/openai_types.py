"""Request bodies of the OpenAI endpoints, parsed and checked by pydantic.

Unknown fields (``user``, ``service_tier``, ...) are ignored, as vLLM does. Ranges of the
sampling parameters are checked by the scheduler, whose messages name the parameter; here
only what the scheduler never sees (``n``, the shape of ``prompt``) is checked.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

MAX_N = 128
"""Most choices one request may ask for (``n`` times the number of prompts)."""


class StreamOptions(BaseModel):
    """``stream_options``: only ``include_usage`` is used."""

    model_config = ConfigDict(extra="ignore")
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Parameters shared by both endpoints, under OpenAI's names plus vLLM's extras."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM-style extras (``extra_body`` in the openai package)
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    # Structured output: {"type": "json_schema", "json_schema": {"schema": {...}}}, {"type": "json_object"}
    response_format: dict[str, Any] | None = None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage


class CompletionRequest(SamplingFields):
    """``POST /v1/completions``: ``logprobs`` is the number of top logprobs per token."""

    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1, le=MAX_N)
    suffix: str | None = None


class ChatCompletionRequest(SamplingFields):
    """``POST /v1/chat/completions``: messages go through the model's chat template in the scheduler."""

    messages: list[dict[str, Any]] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None


class ResponsesRequest(SamplingFields):
    """``POST /v1/responses``: ``instructions`` and ``input`` items in place of messages, flat
    function tools, structured output in ``text.format`` (``responses_input.py`` rewrites it
    as a chat request). ``reasoning``, ``store``, ``metadata``, ``truncation`` and ``include``
    are accepted; only ``metadata`` comes back, in the response."""

    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    text: dict[str, Any] | None = None
    previous_response_id: str | None = None
    metadata: dict[str, Any] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
