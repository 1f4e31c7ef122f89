"""The OpenAI-compatible HTTP gateway: the real `runtime up` with [http], driven by the openai package."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import time
from contextlib import contextmanager

import httpx
import openai
import pytest
from conftest import REPO, running_config
from model_factory import reference_greedy

from runtime.client import SyncClient
from runtime.config import config_to_dict, parse_config
from runtime.gateway.errors import from_scheduler

CONTEXT = 256
START_TIMEOUT_S = 90.0


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _config(tmp_path, folder, port: int, http_extra: str = "") -> object:
    config = tmp_path / f"gateway-{port}.toml"
    config.write_text(
        f'[model]\npath = "{folder}"\n[server]\naddress = "ipc://"\n'
        f"[scheduler]\nmax_running = 16\nmax_context = {CONTEXT}\n[cache]\nkv_slots = 4096\n"
        f'[http]\naddress = "127.0.0.1:{port}"\n{http_extra}\n'
    )
    return config


def _wait_for_line(svc, needle: str, timeout: float = START_TIMEOUT_S) -> str:
    """The first output line containing ``needle`` (the reader thread appends to ``svc.lines``)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for line in list(svc.lines):
            if needle in line:
                return line
        if svc.proc.poll() is not None:
            break
        time.sleep(0.02)  # polling the reader thread's list, bounded by the deadline
    raise AssertionError(f"no line with {needle!r}:\n{svc.log()}")


class Gateway:
    """A running service with its HTTP gateway."""

    def __init__(self, svc, port: int, folder) -> None:
        self.svc = svc
        self.port = port
        self.folder = folder
        self.base = f"http://127.0.0.1:{port}"

    def openai(self, key: str = "x") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=60)

    def async_openai(self, key: str = "x") -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=f"{self.base}/v1", api_key=key, max_retries=0, timeout=60)


@contextmanager
def gateway_service(tmp_path, folder, http_extra: str = ""):
    """`runtime up` with [http] on a free loopback port, once it printed "HTTP on"; always torn down."""
    port = _free_port()
    with running_config(_config(tmp_path, folder, port, http_extra), timeout=START_TIMEOUT_S) as svc:
        line = _wait_for_line(svc, "HTTP on")
        assert f"http://127.0.0.1:{port}" in line
        yield Gateway(svc, port, folder)


@pytest.fixture(scope="module")
def gateway(model_dir, tmp_path_factory):
    with gateway_service(tmp_path_factory.mktemp("gateway"), model_dir("llama")) as gw:
        yield gw


def _ids(folder, text: str) -> list[int]:
    from runtime.scheduler.tokenizer import Tokenizer

    return Tokenizer(str(folder)).encode(text)


def _decode(folder, ids: list[int]) -> str:
    from runtime.scheduler.tokenizer import Tokenizer

    return Tokenizer(str(folder)).decode(ids)


GREEDY = {"temperature": 0, "extra_body": {"ignore_eos": True}}


def test_health_and_models(gateway):
    assert httpx.get(f"{gateway.base}/health", timeout=10).status_code == 200
    models = gateway.openai().models.list()
    assert [m.id for m in models.data] == [gateway.folder.name]
    card = gateway.openai().models.retrieve(gateway.folder.name)
    assert card.id == gateway.folder.name and card.model_dump()["max_model_len"] == CONTEXT
    with pytest.raises(openai.NotFoundError):
        gateway.openai().models.retrieve("other-model")


def test_completion_of_token_ids_is_mlx_lm_greedy(gateway):
    client = gateway.openai()
    for ids in ([5, 17, 42, 9], _ids(gateway.folder, "hello world")):
        reply = client.completions.create(model=gateway.folder.name, prompt=ids, max_tokens=8, **GREEDY)
        expected = reference_greedy(gateway.folder, ids, 8)
        assert reply.object == "text_completion" and reply.id.startswith("cmpl-")
        assert reply.choices[0].text == _decode(gateway.folder, expected)
        assert reply.choices[0].finish_reason == "length"
        assert reply.usage.completion_tokens == 8
        assert reply.usage.prompt_tokens == len(ids)
        assert reply.usage.total_tokens == len(ids) + 8
        assert reply.usage.prompt_tokens_details.cached_tokens >= 0


def test_completion_of_several_prompts_gives_one_choice_each(gateway):
    client = gateway.openai()
    prompts = ["hello world", "the cat"]
    both = client.completions.create(model=gateway.folder.name, prompt=prompts, max_tokens=6, **GREEDY)
    assert [c.index for c in both.choices] == [0, 1]
    for choice, prompt in zip(both.choices, prompts):
        expected = reference_greedy(gateway.folder, _ids(gateway.folder, prompt), 6)
        assert choice.text == _decode(gateway.folder, expected)
    assert both.usage.completion_tokens == 12
    lists = client.completions.create(model=gateway.folder.name, prompt=[[5, 6], [7, 8, 9]], max_tokens=3, **GREEDY)
    assert [len(c.text) > 0 for c in lists.choices] == [True, True] and lists.usage.prompt_tokens == 5


def test_echo_puts_the_prompt_before_each_completion(gateway):
    client = gateway.openai()
    name = gateway.folder.name
    plain = client.completions.create(model=name, prompt=["hello world", "the cat"], max_tokens=5, n=2, **GREEDY)
    echoed = client.completions.create(model=name, prompt=["hello world", "the cat"], max_tokens=5, n=2, echo=True,
                                       **GREEDY)
    assert [c.text for c in echoed.choices] == [p + c.text for p, c in
                                                zip(["hello world"] * 2 + ["the cat"] * 2, plain.choices)]
    assert echoed.usage.completion_tokens == plain.usage.completion_tokens == 20
    ids = [5, 17, 42, 9]
    by_ids = client.completions.create(model=name, prompt=ids, max_tokens=4, echo=True, **GREEDY)
    assert by_ids.choices[0].text == _decode(gateway.folder, ids) + _decode(gateway.folder, reference_greedy(
        gateway.folder, ids, 4))
    streamed = list(client.completions.create(model=name, prompt="hello", max_tokens=6, echo=True, stream=True,
                                              **GREEDY))
    whole = client.completions.create(model=name, prompt="hello", max_tokens=6, echo=True, **GREEDY)
    assert streamed[0].choices[0].text.startswith("hello")
    assert "".join(c.choices[0].text for c in streamed) == whole.choices[0].text
    with pytest.raises(openai.BadRequestError, match="echo with logprobs cannot be streamed"):
        client.completions.create(model=name, prompt="hello", max_tokens=2, echo=True, logprobs=1, stream=True,
                                  **GREEDY)


def test_echo_with_logprobs_scores_the_prompt_tokens(gateway):
    """As evaluation harnesses ask (lm-eval's loglikelihood): echo, logprobs and one new token."""
    from test_prompt_logprobs import _expected

    client = gateway.openai()
    name = gateway.folder.name
    ids = _ids(gateway.folder, "hello world, the cat sat")
    reply = client.completions.create(model=name, prompt=ids, max_tokens=2, echo=True, logprobs=2, **GREEDY)
    lp = reply.choices[0].logprobs
    plain = client.completions.create(model=name, prompt=ids, max_tokens=2, logprobs=2, **GREEDY).choices[0].logprobs
    assert len(lp.tokens) == len(ids) + 2 and lp.tokens[len(ids):] == plain.tokens
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    want = _expected(gateway.folder, ids)
    for i in range(1, len(ids)):
        assert abs(lp.token_logprobs[i] - want[i - 1, ids[i]]) < 2e-3
        # {text: logprob}: two tokens of one text (partial UTF-8) share a key
        assert 1 <= len(lp.top_logprobs[i]) <= 2 and abs(max(lp.top_logprobs[i].values()) - want[i - 1].max()) < 2e-3
    # the plain request may hit the prefix cache (the echoed one never does): float rounding only
    assert lp.token_logprobs[len(ids):] == pytest.approx(plain.token_logprobs, abs=1e-4)
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[0] == 0
    assert reply.choices[0].text.startswith(_decode(gateway.folder, ids))
    # max_tokens 0 (older harnesses): the prompt scored, nothing generated
    scored = client.completions.create(model=name, prompt=ids, max_tokens=0, echo=True, logprobs=2, **GREEDY)
    only = scored.choices[0].logprobs
    assert only.tokens == lp.tokens[: len(ids)] and only.token_logprobs[1:] == pytest.approx(lp.token_logprobs[1:len(ids)])
    assert scored.choices[0].text == _decode(gateway.folder, ids) and scored.usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError, match="max_tokens 0 needs echo"):
        client.completions.create(model=name, prompt=ids, max_tokens=0, **GREEDY)


def test_best_of_returns_the_candidate_of_highest_logprob_per_token(gateway):
    client = gateway.openai()
    name = gateway.folder.name
    sampled = {"temperature": 1.0, "seed": 11, "max_tokens": 6, "extra_body": {"ignore_eos": True}}
    # best_of=4 runs the candidates n=4 gives (seeded: seed + i each), and ranks them.
    candidates = client.completions.create(model=name, prompt="hello world", n=4, logprobs=0, **sampled).choices
    means = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in candidates]
    assert len({c.text for c in candidates}) > 1
    best = client.completions.create(model=name, prompt="hello world", n=2, best_of=4, **sampled)
    ranked = sorted(range(4), key=lambda i: means[i], reverse=True)[:2]
    assert [c.text for c in best.choices] == [candidates[i].text for i in ranked]
    assert [c.index for c in best.choices] == [0, 1] and all(c.logprobs is None for c in best.choices)
    assert best.usage.completion_tokens == 4 * 6  # every candidate's tokens
    with_lp = client.completions.create(model=name, prompt="hello world", best_of=4, logprobs=0, **sampled)
    assert with_lp.choices[0].logprobs.token_logprobs == candidates[ranked[0]].logprobs.token_logprobs
    for extra, needle in (({"best_of": 1, "n": 2}, "at least n"), ({"best_of": 3, "stream": True}, "stream"),
                          ({"suffix": "end"}, "suffix")):
        with pytest.raises(openai.BadRequestError, match=needle):
            client.completions.create(model=name, prompt="hello", max_tokens=2, **extra)


def test_chat_greedy_and_streaming_equal_non_streaming(gateway):
    client = gateway.openai()
    messages = [{"role": "user", "content": "hello there"}]
    whole = client.chat.completions.create(model=gateway.folder.name, messages=messages, max_tokens=10, **GREEDY)
    assert whole.object == "chat.completion" and whole.id.startswith("chatcmpl-")
    assert whole.choices[0].message.role == "assistant"
    assert whole.usage.completion_tokens == 10
    # The scheduler renders the template as transformers does: the same greedy tokens as mlx-lm.
    from runtime.scheduler.tokenizer import Tokenizer

    hf = Tokenizer(str(gateway.folder)).hf
    prompt = list(hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False))
    assert whole.usage.prompt_tokens == len(prompt)
    assert whole.choices[0].message.content == _decode(gateway.folder, reference_greedy(gateway.folder, prompt, 10))

    chunks = list(client.chat.completions.create(model=gateway.folder.name, messages=messages, max_tokens=10,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finishes == ["length"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 10
    assert chunks[-1].usage.prompt_tokens == len(prompt)

    streamed = client.completions.create(model=gateway.folder.name, prompt="hello", max_tokens=7, stream=True,
                                         **GREEDY)
    plain = client.completions.create(model=gateway.folder.name, prompt="hello", max_tokens=7, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == plain.choices[0].text


def test_defaults_run_to_the_context_and_logit_bias_applies(gateway):
    client = gateway.openai()
    reply = client.completions.create(model=gateway.folder.name, prompt=[5, 6, 7], **GREEDY)  # no max_tokens
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage.total_tokens == CONTEXT
    biased = client.completions.create(model=gateway.folder.name, prompt=[5, 6, 7], max_tokens=4,
                                       logit_bias={"42": 100}, **GREEDY)
    assert biased.choices[0].text == _decode(gateway.folder, [42] * 4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=gateway.folder.name, prompt="hi", max_tokens=2, logit_bias={"x": 1})


def test_logprobs_in_openai_shapes(gateway):
    client = gateway.openai()
    chat = client.chat.completions.create(model=gateway.folder.name, messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=5, logprobs=True, top_logprobs=3, **GREEDY)
    content = chat.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3 and entry.logprob <= 0
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)  # greedy: the best token
        assert entry.bytes == list(entry.token.encode())
    assert "".join(e.token for e in content) == chat.choices[0].message.content
    text = client.completions.create(model=gateway.folder.name, prompt="hello", max_tokens=4, logprobs=2, **GREEDY)
    lp = text.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert all(len(top) <= 2 for top in lp.top_logprobs) and lp.text_offset[0] == 0


def test_n_with_seed_is_reproducible(gateway):
    client = gateway.openai()
    kwargs = dict(model=gateway.folder.name, prompt="the", max_tokens=12, n=3, seed=11, temperature=1.0,
                  extra_body={"ignore_eos": True})
    first = client.completions.create(**kwargs)
    again = client.completions.create(**kwargs)
    assert [c.index for c in first.choices] == [0, 1, 2]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert first.usage.completion_tokens == 36
    chat = client.chat.completions.create(model=gateway.folder.name, messages=[{"role": "user", "content": "x"}],
                                          max_tokens=4, n=2, seed=3, temperature=1.0)
    assert len(chat.choices) == 2


def test_stop_string_ends_the_text(gateway):
    client = gateway.openai()
    full = client.completions.create(model=gateway.folder.name, prompt=[5, 17, 42], max_tokens=16, **GREEDY)
    text = full.choices[0].text
    stop = text[4:6]
    assert stop.strip(), f"the greedy text {text!r} gives no usable stop string"
    cut = client.completions.create(model=gateway.folder.name, prompt=[5, 17, 42], max_tokens=16, stop=[stop],
                                    **GREEDY)
    assert cut.choices[0].text == text[: text.index(stop)]
    assert cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=gateway.folder.name, prompt=[5, 17, 42], max_tokens=16, stop=stop,
                                         stream=True, **GREEDY)
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text


def test_bad_parameters_and_long_prompts_are_400(gateway):
    client = gateway.openai()
    with pytest.raises(openai.BadRequestError) as bad:
        client.completions.create(model=gateway.folder.name, prompt="hi", max_tokens=4, top_p=2)
    assert "top_p" in bad.value.message
    with pytest.raises(openai.BadRequestError) as bad_stream:
        client.chat.completions.create(model=gateway.folder.name, messages=[{"role": "user", "content": "hi"}],
                                       max_tokens=4, top_p=2, stream=True)
    assert "top_p" in bad_stream.value.message
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=gateway.folder.name, prompt=[5] * (CONTEXT + 10), max_tokens=4)
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model=gateway.folder.name, prompt="hi", max_tokens=4, n=0)
    reply = httpx.post(f"{gateway.base}/v1/completions", json={"prompt": {"not": "a prompt"}}, timeout=10)
    assert reply.status_code == 400 and set(reply.json()["error"]) == {"message", "type", "param", "code"}
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="hi", max_tokens=2)


def test_error_messages_map_to_statuses():
    cases = [  # the scheduler's messages, as runtime/scheduler/server.py and core.py word them
        ("top_p must be in (0, 1] (1 = off), got 2", 400, None),
        ("the prompt (300 tokens) and max_tokens (16) exceed the context of 256 tokens", 400, None),
        ("invalid regex: worker died", 400, None),  # quoting the client's text is still the client's error
        ("overloaded: 5 requests are waiting (scheduler.max_waiting); retry later", 429, "overloaded"),
        ("worker unavailable, retrying (worker died (exit status -9)); send the request again shortly", 503,
         "unavailable"),
        ("the service is shutting down", 503, "unavailable"),
        ("worker died (exit status -9)", 500, "worker_failed"),
        ("worker disconnected", 500, "worker_failed"),
        ("worker stopped responding (no step for 120 s)", 500, "worker_failed"),
        ("the worker failed a step: RuntimeError('out of memory')", 500, "worker_failed"),
        ("the grammar refused token 7: unexpected token", 500, "worker_failed"),
        ("internal error: KeyError('x')", 500, "internal_error"),
    ]
    for message, status, code in cases:
        error = from_scheduler(message)
        assert (error.status, error.code, error.message) == (status, code, message), message
        assert error.body()["error"]["message"] == message
    assert from_scheduler("worker died (exit status -9)").body()["error"]["type"] == "server_error"
    assert from_scheduler("the service is shutting down").body()["error"]["type"] == "service_unavailable"


async def test_32_concurrent_streams_complete(gateway):
    client = gateway.async_openai()

    async def one(i: int) -> tuple[str, int]:
        stream = await client.completions.create(model=gateway.folder.name, prompt=f"story {i}", max_tokens=16,
                                                 stream=True, stream_options={"include_usage": True}, **GREEDY)
        text, usage = "", None
        async for chunk in stream:
            if chunk.choices:
                text += chunk.choices[0].text
            if chunk.usage is not None:
                usage = chunk.usage
        return text, usage.completion_tokens

    try:
        results = await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 60)
    finally:
        await client.close()
    assert [tokens for _, tokens in results] == [16] * 32


def test_closed_stream_aborts_its_request(gateway):
    client = gateway.openai()
    with SyncClient(gateway.svc.address) as scheduler:  # connected first: the stream's tokens come fast
        stream = client.completions.create(model=gateway.folder.name, prompt="a long one", max_tokens=CONTEXT - 20,
                                           stream=True, **GREEDY)
        for i, _ in enumerate(stream):
            if i == 2:
                break
        assert scheduler.status().running == 1
        stream.close()
        deadline = time.monotonic() + 2.0
        while scheduler.status().running != 0:
            assert time.monotonic() < deadline, "the request kept running after its HTTP client left"


def _metric(text: str, name: str, default: float | None = None) -> float:
    for line in text.splitlines():
        if line.startswith(name):
            return float(line.rsplit(" ", 1)[1])
    if default is not None:  # a labelled series appears with its first sample
        return default
    raise AssertionError(f"{name} not in /metrics")


def test_metrics(gateway):
    before = httpx.get(f"{gateway.base}/metrics", timeout=10).text
    for name in ("runtime_time_to_first_token_seconds", "runtime_inter_token_latency_seconds",
                 "runtime_e2e_request_latency_seconds", "runtime_request_queue_time_seconds",
                 "runtime_num_requests_running", "runtime_num_requests_waiting", "runtime_kv_cache_usage_ratio",
                 "runtime_prompt_tokens_total", "runtime_cached_prompt_tokens_total", "runtime_requests_total",
                 "runtime_worker_restarts_total", "runtime_prefix_cache_hit_ratio"):
        assert name in before, name
    gateway.openai().completions.create(model=gateway.folder.name, prompt="hi", max_tokens=5, **GREEDY)
    after = httpx.get(f"{gateway.base}/metrics", timeout=10).text
    generated = "runtime_generation_tokens_total{"
    assert _metric(after, generated) == _metric(before, generated, default=0.0) + 5
    assert f'model="{gateway.folder.name}"' in after
    assert 0.0 <= _metric(after, "runtime_kv_cache_usage_ratio{") <= 1.0


def test_api_keys_and_no_gateway_left_after_sigterm(model_dir, tmp_path):
    with gateway_service(tmp_path, model_dir("llama"), 'api_keys = ["secret-key"]\nserved_model_name = "tiny"') as gw:
        with pytest.raises(openai.AuthenticationError):
            gw.openai("wrong").completions.create(model="tiny", prompt="hi", max_tokens=2)
        assert httpx.get(f"{gw.base}/v1/models", timeout=10).status_code == 401
        reply = gw.openai("secret-key").completions.create(model="tiny", prompt="hi", max_tokens=2, **GREEDY)
        assert reply.model == "tiny" and reply.usage.completion_tokens == 2
        assert httpx.get(f"{gw.base}/health", timeout=10).status_code == 200  # no key needed
        proc = gw.svc.proc
        children = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True).stdout.split()
        assert len(children) >= 2, "the worker and the gateway should be children of `runtime up`"
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=15)
        for pid in children:
            with pytest.raises(ProcessLookupError):
                os.kill(int(pid), 0)


def _up(config) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "runtime.cli", "up", "-c", str(config)], capture_output=True,
                          text=True, timeout=60, cwd=REPO)


@pytest.mark.parametrize(
    "http, needle",
    [
        ('address = "0.0.0.0:8123"', "http.api_keys"),
        ("workers = 0", "http.workers"),
        ('address = "nope"', "http.address"),
        ("bogus = 1", "http.bogus"),
    ],
)
def test_bad_http_config_exits_2(tmp_path, http, needle):
    config = tmp_path / "bad.toml"
    config.write_text(f'[model]\npath = "/x"\n[http]\n{http}\n')
    done = _up(config)
    assert done.returncode == 2 and needle in done.stderr


def test_busy_port_fails_in_one_line(model_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = _up(_config(tmp_path, model_dir("llama"), port))
    assert done.returncode == 1
    assert done.stderr.strip().count("\n") == 0 and f"127.0.0.1:{port}" in done.stderr
    assert "in use" in done.stderr


@pytest.mark.parametrize("http", [None, {"address": "127.0.0.1:9000", "api_keys": ["k"]}])
def test_config_round_trips_to_the_worker(http):
    """The worker re-parses ``config_to_dict``: an absent [http] must stay absent."""
    table = {"model": {"path": "/x"}} | ({"http": http} if http else {})
    config = parse_config(table)
    assert parse_config(json.loads(json.dumps(config_to_dict(config)))) == config  # as worker_process sends it
    assert (config.http is None) == (http is None)


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="reads /proc")
def test_gateway_exits_when_runtime_up_is_killed(model_dir, tmp_path):
    """SIGKILL gives `runtime up` no chance to stop the gateway: it notices its stdin closing."""
    with gateway_service(tmp_path, model_dir("llama")) as gw:
        children = subprocess.run(["pgrep", "-P", str(gw.svc.proc.pid)], capture_output=True, text=True).stdout.split()
        gateways = [int(pid) for pid in children
                    if b"runtime.gateway.main" in open(f"/proc/{pid}/cmdline", "rb").read()]
        assert len(gateways) == 1
        os.kill(gw.svc.proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10.0
        while _alive(gateways[0]):
            assert time.monotonic() < deadline, "the gateway outlived `runtime up`"
            time.sleep(0.05)  # polling a process that is not ours to wait on, bounded by the deadline
