"""OpenAI requests to ``Client.stream`` keyword arguments, and results to OpenAI's shapes."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from runtime.client import GenerationResult, TokenLogprob
from runtime.gateway.errors import ApiError
from runtime.gateway.openai_types import (
    MAX_N,
    ChatCompletionRequest,
    CompletionRequest,
    SamplingFields,
)
from runtime.gateway.tokens import TokenText
from runtime.gateway.tool_choice import ToolPlan

_PASSED_AS_IS = ("top_p", "presence_penalty", "frequency_penalty", "stop", "top_k", "min_p",
                 "repetition_penalty", "min_tokens", "stop_token_ids")


@dataclass(frozen=True)
class Limits:
    """Facts of the service a request's defaults depend on."""

    max_context: int


def _logit_bias(bias: dict[str, float]) -> dict[int, float]:
    out = {}
    for key, value in bias.items():
        if not key.isdigit():
            raise ApiError(400, f"logit_bias keys must be token ids, got {key!r}", param="logit_bias")
        out[int(key)] = value
    return out


def _sampling(req: SamplingFields, max_tokens: int | None, limits: Limits) -> dict:
    kwargs: dict = {
        # OpenAI's defaults: sample at temperature 1, up to the end of the context.
        "max_tokens": limits.max_context if max_tokens is None else max_tokens,
        "temperature": 1.0 if req.temperature is None else req.temperature,
        "ignore_eos": req.ignore_eos,
    }
    for name in _PASSED_AS_IS:
        value = getattr(req, name)
        if value is not None:
            kwargs[name] = value
    if req.logit_bias:
        kwargs["logit_bias"] = _logit_bias(req.logit_bias)
    if req.seed is not None:
        kwargs["seed"] = req.seed
    kwargs.update(_response_format(req.response_format))
    return kwargs


def _response_format(fmt: dict | None) -> dict:
    """OpenAI's ``response_format`` as the client's structured-output keywords."""
    kind = (fmt or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        schema = (fmt.get("json_schema") or {}).get("schema") if isinstance(fmt.get("json_schema"), dict) else None
        if not isinstance(schema, dict):
            raise ApiError(400, "response_format json_schema needs json_schema.schema, a JSON Schema object",
                           param="response_format")
        return {"json_schema": schema}
    raise ApiError(400, f"response_format type must be text, json_object or json_schema, got {kind!r}",
                   param="response_format")


def _fan_out(base: dict, n: int) -> list[dict]:
    """``n`` copies of one request; with a seed, choice i uses seed + i so they differ reproducibly."""
    out = []
    for i in range(n):
        kwargs = dict(base)
        if "seed" in kwargs:
            kwargs["seed"] = kwargs["seed"] + i
        out.append(kwargs)
    return out


def completion_requests(req: CompletionRequest, limits: Limits) -> list[dict]:
    """One ``Client.stream`` call per choice: prompt-major, ``n`` per prompt."""
    if req.echo and req.logprobs is not None and req.stream:
        raise ApiError(400, "echo with logprobs cannot be streamed (the prompt's logprobs come at the end)",
                       param="echo")
    if req.max_tokens == 0 and not (req.echo and not req.stream):
        raise ApiError(400, "max_tokens 0 needs echo, without streaming (it scores the prompt only)",
                       param="max_tokens")
    prompt = req.prompt
    if isinstance(prompt, str):
        prompts: list[dict] = [{"prompt": prompt}]
    elif prompt and all(isinstance(p, int) for p in prompt):
        prompts = [{"token_ids": list(prompt)}]
    elif prompt and all(isinstance(p, str) for p in prompt):
        prompts = [{"prompt": p} for p in prompt]
    elif prompt and all(isinstance(p, list) for p in prompt):
        prompts = [{"token_ids": list(p)} for p in prompt]
    else:
        raise ApiError(400, "prompt must be a string, a list of strings, token ids or lists of token ids",
                       param="prompt")
    if req.suffix:
        raise ApiError(400, "suffix is not supported", param="suffix")
    per_prompt = best_of(req)
    if len(prompts) * per_prompt > MAX_N:
        raise ApiError(400, f"at most {MAX_N} choices per request (prompts times n, or best_of)", param="n")
    base = _sampling(req, 1 if req.max_tokens == 0 else req.max_tokens, limits)  # 0: one token, dropped
    if req.logprobs is not None or per_prompt > req.n:  # best_of ranks the candidates by their logprobs
        base.update(logprobs=True, top_logprobs=req.logprobs or 0)
    if req.echo and req.logprobs is not None:
        base["prompt_logprobs"] = req.logprobs
    return [kw | p for p in prompts for kw in _fan_out(base, per_prompt)]


def best_of(req: CompletionRequest) -> int:
    """Candidates generated per prompt: ``best_of`` (at least ``n``; not with streaming), else ``n``."""
    if req.best_of is None or req.best_of == req.n:
        return req.n
    if req.best_of < req.n:
        raise ApiError(400, f"best_of ({req.best_of}) must be at least n ({req.n})", param="best_of")
    if req.stream:
        raise ApiError(400, "best_of cannot be used with stream", param="best_of")
    return req.best_of


def pick_best(results: list[GenerationResult], per_prompt: int, n: int, keep_logprobs: bool) -> list[GenerationResult]:
    """Each prompt's ``n`` candidates of the highest log-probability per token (OpenAI's
    ``best_of``), best first; ``keep_logprobs`` false drops the logprobs only ranking needed."""
    def score(r: GenerationResult) -> float:
        lps = [e.logprob for e in r.logprobs or []]
        return sum(lps) / len(lps) if lps else float("-inf")

    out = []
    for at in range(0, len(results), per_prompt):
        ranked = sorted(results[at:at + per_prompt], key=score, reverse=True)[:n]
        out += ranked if keep_logprobs else [dataclasses.replace(r, logprobs=None) for r in ranked]
    return out


def prompt_only(result: GenerationResult) -> GenerationResult:
    """``max_tokens`` 0 with ``echo``: the result without the one token run to score the prompt."""
    return dataclasses.replace(result, token_ids=[], text="", finish_reason="length", stop_reason=None,
                               logprobs=[] if result.logprobs is not None else None)


def echo_texts(req: CompletionRequest, text: TokenText) -> list[str]:
    """``echo``: each prompt's text, put before its choices' completions (token-id prompts decoded)."""
    prompts = [req.prompt] if isinstance(req.prompt, str) or isinstance(req.prompt[0], int) else req.prompt
    return [p if isinstance(p, str) else text.tokenizer.decode(p) for p in prompts]


def chat_requests(req: ChatCompletionRequest, limits: Limits, tools: ToolPlan) -> list[dict]:
    """One ``Client.stream(messages=...)`` call per choice; ``tools`` from ``tool_choice.plan_tools``."""
    max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    base = _sampling(req, max_tokens, limits)
    base["messages"] = req.messages
    if tools.tools is not None:
        base["tools"] = tools.tools
    if tools.grammar is not None:
        base["grammar"] = tools.grammar
    if req.chat_template_kwargs is not None:
        base["chat_template_kwargs"] = req.chat_template_kwargs
    if req.logprobs:
        base.update(logprobs=True, top_logprobs=req.top_logprobs or 0)
    elif req.top_logprobs:
        raise ApiError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
    return _fan_out(base, req.n)


def usage(results: list[GenerationResult], per_prompt: int) -> dict:
    """OpenAI's usage: each prompt counted once (its first choice), completion tokens of all choices."""
    firsts = results[::per_prompt]
    prompt = sum(r.prompt_tokens for r in firsts)
    completion = sum(len(r.token_ids) for r in results)
    return {
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": sum(r.cached_tokens for r in firsts)},
    }


def finish_reason(result: GenerationResult) -> str:
    return result.finish_reason if result.finish_reason in ("stop", "length") else "stop"


def chat_logprobs(entries: list[TokenLogprob] | None, text: TokenText) -> dict | None:
    """OpenAI's chat shape: ``{"content": [{token, logprob, bytes, top_logprobs}]}``."""
    if entries is None:
        return None

    def one(token_id: int, logprob: float) -> dict:
        token = text.of(token_id)
        return {"token": token, "logprob": logprob, "bytes": list(token.encode("utf-8"))}

    return {"content": [one(e.token_id, e.logprob) | {"top_logprobs": [one(t, lp) for t, lp in e.top]}
                        for e in entries]}


def echo_logprobs(result: GenerationResult, text: TokenText) -> dict | None:
    """``echo`` with ``logprobs``: the prompt's tokens first (the first one has no logprob, as
    in OpenAI's replies), then the completion's."""
    if not result.prompt_token_ids or result.prompt_logprobs is None or result.logprobs is None:
        return None
    first = TokenLogprob(result.prompt_token_ids[0], 0.0)  # a placeholder: no logprob before the first token
    out = completion_logprobs([first] + result.prompt_logprobs + result.logprobs, text)
    assert out is not None
    out["token_logprobs"][0] = out["top_logprobs"][0] = None
    return out


def completion_logprobs(entries: list[TokenLogprob] | None, text: TokenText, offset: int = 0) -> dict | None:
    """The legacy completions shape: parallel lists, ``top_logprobs`` as {token: logprob}."""
    if entries is None:
        return None
    tokens = [text.of(e.token_id) for e in entries]
    offsets, at = [], offset
    for token in tokens:
        offsets.append(at)
        at += len(token)
    return {
        "tokens": tokens,
        "token_logprobs": [e.logprob for e in entries],
        "top_logprobs": [_by_text(e.top, text) for e in entries],
        "text_offset": offsets,
    }


def _by_text(top: list[tuple[int, float]], text: TokenText) -> dict[str, float]:
    """{token text: logprob}, best first; tokens of one text (partial UTF-8) keep the best one's."""
    out: dict[str, float] = {}
    for token_id, logprob in top:
        out.setdefault(text.of(token_id), logprob)
    return out
