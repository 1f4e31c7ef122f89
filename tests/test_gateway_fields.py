"""Issue 17's gaps, through the real gateway: each extra sampling field reaches the scheduler
(the ZMQ client with the same keyword on the same service is the oracle), ``n`` with a seed,
the prefix cache in ``usage``, the metrics that move, and reasoning split from content."""

from __future__ import annotations

import httpx
import pytest
from model_factory import tokenizer_eos_id, with_chat_template
from prometheus_client.parser import text_string_to_metric_families
from test_gateway import gateway_service

from runtime.client import GenerationResult, SyncClient

# model_factory's plain template, plus an open <think> block when enable_thinking is set.
THINK_TEMPLATE = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% if enable_thinking %}<think>{% endif %}{% endif %}"
)
PROMPT = [5, 17, 42, 9]
MESSAGES = [{"role": "user", "content": "hello there"}]
# Keyword arguments of the openai package; the rest goes in extra_body (vLLM's extras).
OPENAI_KEYWORDS = frozenset({"max_tokens", "max_completion_tokens", "temperature", "seed", "n", "logit_bias",
                             "presence_penalty", "frequency_penalty", "stop", "response_format", "stream"})


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    root = tmp_path_factory.mktemp("gateway-fields")
    folder = with_chat_template(model_dir("llama"), root / "thinker", THINK_TEMPLATE)
    with gateway_service(root, folder) as gw:
        yield gw


@pytest.fixture(scope="module")
def scheduler(gateway):
    """The ZMQ client of the gateway's own scheduler."""
    with SyncClient(gateway.svc.address, timeout_s=60) as client:
        yield client


class Reply:
    """One choice of an HTTP reply, whichever endpoint made it."""

    def __init__(self, body, choice: int = 0) -> None:
        picked = body.choices[choice]
        self.text = picked.text if body.object == "text_completion" else picked.message.content
        self.finish_reason = picked.finish_reason
        self.usage = body.usage


def _http(gateway, endpoint: str, **fields):
    """The openai package's reply to ``fields`` on ``endpoint`` ("completions" or "chat")."""
    known = {k: v for k, v in fields.items() if k in OPENAI_KEYWORDS}
    extra = {k: v for k, v in fields.items() if k not in OPENAI_KEYWORDS}
    client, model = gateway.openai(), gateway.folder.name
    if endpoint == "chat":
        return client.chat.completions.create(model=model, messages=MESSAGES, extra_body=extra, **known)
    return client.completions.create(model=model, prompt=PROMPT, extra_body=extra, **known)


def _ask(gateway, endpoint: str, **fields) -> Reply:
    return Reply(_http(gateway, endpoint, **fields))


def _zmq(scheduler: SyncClient, endpoint: str, **fields) -> GenerationResult:
    """The same request through the ZMQ client (logit_bias keys as ints, as it takes them)."""
    if "logit_bias" in fields:
        fields["logit_bias"] = {int(k): v for k, v in fields["logit_bias"].items()}
    if endpoint == "chat":
        return scheduler.chat(MESSAGES, **fields)
    return scheduler.generate(token_ids=PROMPT, **fields)


ENDPOINTS = pytest.mark.parametrize("endpoint", ["completions", "chat"])
GREEDY = {"temperature": 0.0, "ignore_eos": True, "max_tokens": 24}


@ENDPOINTS
@pytest.mark.parametrize("field, value", [("presence_penalty", 2.0), ("frequency_penalty", 2.0),
                                          ("repetition_penalty", 10.0)])
def test_penalties_reach_the_request(gateway, scheduler, endpoint, field, value):
    greedy = GREEDY | {"max_tokens": 48}
    plain = _zmq(scheduler, endpoint, **greedy)
    assert len(set(plain.token_ids)) < len(plain.token_ids), "greedy repeats no token: no penalty can show"
    penalized = _ask(gateway, endpoint, **greedy, **{field: value})
    assert penalized.text != plain.text
    assert penalized.text == _zmq(scheduler, endpoint, **greedy, **{field: value}).text


@ENDPOINTS
@pytest.mark.parametrize("field, value", [("top_k", 1), ("min_p", 1.0)])
def test_top_k_1_and_min_p_1_sample_the_greedy_token(gateway, scheduler, endpoint, field, value):
    hot = {"temperature": 2.0, "seed": 5, "ignore_eos": True, "max_tokens": 16}
    greedy = _zmq(scheduler, endpoint, **GREEDY | {"max_tokens": 16}).text
    assert _ask(gateway, endpoint, **hot).text != greedy, "temperature 2 gave the greedy text anyway"
    assert _ask(gateway, endpoint, **hot, **{field: value}).text == greedy


@ENDPOINTS
def test_min_tokens_holds_back_a_forced_eos(gateway, scheduler, endpoint):
    eos = {"temperature": 0.0, "max_tokens": 20, "logit_bias": {str(tokenizer_eos_id(gateway.folder)): 100.0}}
    at_once = _ask(gateway, endpoint, **eos)
    assert (at_once.usage.completion_tokens, at_once.text, at_once.finish_reason) == (1, "", "stop")
    held = _ask(gateway, endpoint, **eos, min_tokens=5)
    # Five tokens of text, then the EOS: counted as a completion token, never shown as text.
    assert held.usage.completion_tokens == 6 and held.finish_reason == "stop"
    assert held.text and held.text == _zmq(scheduler, endpoint, **eos, min_tokens=5).text


@ENDPOINTS
def test_stop_token_ids_end_at_the_named_token(gateway, scheduler, endpoint):
    ids = _zmq(scheduler, endpoint, **GREEDY).token_ids
    at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])
    stopped = _ask(gateway, endpoint, **GREEDY, stop_token_ids=[ids[at]])
    assert stopped.finish_reason == "stop" and stopped.usage.completion_tokens == at + 1
    assert stopped.text == _zmq(scheduler, endpoint, **GREEDY | {"max_tokens": at}).text


def test_max_completion_tokens_wins_over_max_tokens_on_chat(gateway):
    reply = _ask(gateway, "chat", temperature=0.0, ignore_eos=True, max_completion_tokens=3)
    assert (reply.usage.completion_tokens, reply.finish_reason) == (3, "length")
    both = _ask(gateway, "chat", temperature=0.0, ignore_eos=True, max_completion_tokens=3, max_tokens=10)
    assert both.usage.completion_tokens == 3


@ENDPOINTS
def test_n_with_a_seed_runs_seeds_seed_plus_i(gateway, scheduler, endpoint):
    fields = {"temperature": 1.0, "max_tokens": 12, "ignore_eos": True}
    body = _http(gateway, endpoint, **fields, n=3, seed=40)
    texts = [Reply(body, i).text for i in range(3)]
    assert len(set(texts)) == 3
    assert texts == [_zmq(scheduler, endpoint, **fields, seed=40 + i).text for i in range(3)]
    assert body.usage.completion_tokens == 36


def test_chat_n_counts_its_prompt_once(gateway):
    one = _http(gateway, "chat", temperature=1.0, max_tokens=2, seed=1)
    three = _http(gateway, "chat", temperature=1.0, max_tokens=2, seed=1, n=3)
    assert three.usage.prompt_tokens == one.usage.prompt_tokens


def test_a_repeated_prompt_is_served_from_the_prefix_cache(gateway):
    client, model = gateway.openai(), gateway.folder.name
    prompt = "the quick brown fox jumps over the lazy dog near the river bank"  # sent by no other test
    first = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    again = client.completions.create(model=model, prompt=prompt, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert 0 < again.usage.prompt_tokens_details.cached_tokens < again.usage.prompt_tokens
    assert again.choices[0].text == first.choices[0].text


def _samples(gateway) -> dict[tuple[str, frozenset], float]:
    """Every sample of /metrics by (name, labels)."""
    text = httpx.get(f"{gateway.base}/metrics", timeout=10).text
    return {(s.name, frozenset(s.labels.items())): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def test_metrics_move_with_requests(gateway):
    model = ("model", gateway.folder.name)
    before = _samples(gateway)
    client = gateway.openai()
    prompt = "a small cat sees the old house"  # sent by no other test
    chunks = list(client.completions.create(model=gateway.folder.name, prompt=prompt, max_tokens=6, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    streamed = chunks[-1].usage
    eos = str(tokenizer_eos_id(gateway.folder))
    stopped = client.completions.create(model=gateway.folder.name, prompt=prompt, max_tokens=6, temperature=0,
                                        logit_bias={eos: 100.0}).usage
    after = _samples(gateway)

    def moved(name: str, *labels: tuple[str, str]) -> float:
        key = (name, frozenset({model, *labels}))
        assert key in after, f"{key} not in /metrics"
        return after[key] - before.get(key, 0.0)

    # One sample per token after the first chunk's: six streamed tokens make one to five.
    assert 1 <= moved("runtime_inter_token_latency_seconds_count") <= 5
    assert moved("runtime_time_to_first_token_seconds_count") == 2
    assert moved("runtime_e2e_request_latency_seconds_count") == 2
    assert moved("runtime_prompt_tokens_total") == streamed.prompt_tokens + stopped.prompt_tokens
    cached = stopped.prompt_tokens_details.cached_tokens
    assert cached > 0 and moved("runtime_cached_prompt_tokens_total") == cached  # the second prompt was cached
    assert moved("runtime_generation_tokens_total") == 6 + 1
    assert moved("runtime_requests_total", ("finish_reason", "length")) == 1
    assert moved("runtime_requests_total", ("finish_reason", "stop")) == 1
    assert after[("runtime_prefix_cache_hit_ratio", frozenset({model}))] > 0


JSON_STRING = {"type": "json_schema", "json_schema": {"name": "text", "schema": {"type": "string",
                                                                                 "const": "x</think>y"}}}
THINKING = {"chat_template_kwargs": {"enable_thinking": True}}


def test_reasoning_is_split_when_the_prompt_opens_a_think_block(gateway):
    fields = {"temperature": 0.0, "max_tokens": 30, "response_format": JSON_STRING}
    plain = _http(gateway, "chat", **fields)
    message = plain.choices[0].message
    assert message.content == '"x</think>y"' and getattr(message, "reasoning_content", None) is None
    thinking = _http(gateway, "chat", **fields, **THINKING)
    assert thinking.usage.prompt_tokens > plain.usage.prompt_tokens  # the template wrote <think>
    message = thinking.choices[0].message
    assert (message.reasoning_content, message.content) == ('"x', 'y"')
    chunks = list(_http(gateway, "chat", **fields, **THINKING, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(getattr(d, "reasoning_content", None) or "" for d in deltas) == '"x'
    assert "".join(d.content or "" for d in deltas) == 'y"'


def test_a_think_block_in_the_reply_is_split_too(gateway):
    fmt = {"type": "json_schema", "json_schema": {"name": "text", "schema": {"const": "<think>plan</think>done"}}}
    message = _http(gateway, "chat", temperature=0.0, max_tokens=30, response_format=fmt).choices[0].message
    assert (message.reasoning_content, message.content) == ("plan", '"done"')
