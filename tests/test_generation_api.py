"""The generation API through the real service: sampling per row, seeds, bias, penalties, logprobs,
stop strings, min_tokens, chat templates, and invalid parameters."""

from __future__ import annotations

import asyncio

import mlx.core as mx
import pytest
from conftest import REPO, running_service
from mlx_lm.generate import generate_step
from model_factory import load_cached, reference_greedy
from transformers import AutoTokenizer

from runtime.client import Client

EXTRA = "[cache]\nkv_slots = 8192\n[scheduler]\nmax_running = 20\nmax_context = 512\n"
PROMPT = [5, 6, 7, 8]


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    folder = model_dir("llama")
    with running_service(tmp_path_factory.mktemp("svc"), folder, EXTRA) as svc:
        yield folder, svc


def _reference(folder, prompt_ids, max_tokens, processor=None):
    """mlx-lm's greedy tokens and log-probability vectors (float32), optionally with a logits processor."""
    model, _ = load_cached(folder)
    prompt = mx.array(list(prompt_ids), dtype=mx.uint32)
    tokens, logprobs = [], []
    processors = [processor] if processor is not None else None
    for tok, lp in generate_step(prompt, model, max_tokens=max_tokens, sampler=lambda x: mx.argmax(x, axis=-1),
                                 logits_processors=processors):
        tokens.append(int(tok))
        logprobs.append(lp.astype(mx.float32))
    return tokens, logprobs


async def test_seeded_sampling_is_batch_invariant(served):
    _, svc = served
    hot = dict(temperature=1.0, max_tokens=24, ignore_eos=True)
    async with Client(svc.address, timeout_s=60) as client:
        alone = await client.generate(token_ids=PROMPT, seed=1234, **hot)
        again = await client.generate(token_ids=PROMPT, seed=1234, **hot)
        other = await client.generate(token_ids=PROMPT, seed=99, **hot)
        mixed = [
            dict(temperature=0.7, top_p=0.9, seed=7),
            dict(temperature=1.3, top_k=5),
            dict(temperature=0.0),
            dict(temperature=1.0, frequency_penalty=1.0, logprobs=True, top_logprobs=3),
            dict(temperature=0.9, min_p=0.1, logit_bias={3: 5.0}),
        ]
        batch = [
            client.generate(token_ids=[9, i % 7 + 1, 4], max_tokens=24 + i, ignore_eos=True, **mixed[i % len(mixed)])
            for i in range(15)
        ]
        results = await asyncio.gather(client.generate(token_ids=PROMPT, seed=1234, **hot), *batch)
        unseeded = await asyncio.gather(*[client.generate(token_ids=PROMPT, **hot) for _ in range(2)])
    assert alone.token_ids == again.token_ids == results[0].token_ids
    assert other.token_ids != alone.token_ids
    assert unseeded[0].token_ids != unseeded[1].token_ids  # random per request without a seed
    assert all(r.finish_reason == "length" for r in results)


async def test_top_k_one_is_greedy_and_filters_keep_the_greedy_row_exact(served):
    folder, svc = served
    async with Client(svc.address, timeout_s=60) as client:
        runs = await asyncio.gather(
            client.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True, temperature=1.5, top_k=1),
            client.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True),
            client.generate(token_ids=PROMPT, max_tokens=16, ignore_eos=True, temperature=2.0, seed=3),
        )
    expected = reference_greedy(folder, PROMPT, 16)
    assert runs[0].token_ids == expected and runs[1].token_ids == expected


async def test_logit_bias_forces_and_forbids_tokens(served):
    folder, svc = served
    greedy = reference_greedy(folder, PROMPT, 8)
    async with Client(svc.address, timeout_s=60) as client:
        forced = await client.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True, logit_bias={17: 100.0})
        forbidden = await client.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True,
                                          logit_bias={t: -100.0 for t in set(greedy)})
        hot = await client.generate(token_ids=PROMPT, max_tokens=8, ignore_eos=True, temperature=1.0, seed=5,
                                    logit_bias={17: 100.0})
    assert forced.token_ids == [17] * 8 and hot.token_ids == [17] * 8
    assert not set(forbidden.token_ids) & set(greedy)


async def test_logprobs_equal_mlx_lm(served):
    folder, svc = served
    expected, ref_lps = _reference(folder, PROMPT, 10)
    async with Client(svc.address, timeout_s=60) as client:
        result = await client.generate(token_ids=PROMPT, max_tokens=10, ignore_eos=True, logprobs=True, top_logprobs=5)
        plain = await client.generate(token_ids=PROMPT, max_tokens=10, ignore_eos=True)
        streamed = []
        async for chunk in client.stream(token_ids=PROMPT, max_tokens=10, ignore_eos=True, logprobs=True):
            streamed.extend(chunk.logprobs or [])
    assert result.token_ids == expected and plain.logprobs is None
    assert [e.token_id for e in result.logprobs] == expected
    for entry, ref in zip(result.logprobs, ref_lps):
        assert entry.logprob == pytest.approx(ref[entry.token_id].item(), abs=1e-4)
        best = mx.argsort(-ref)[:5].tolist()
        assert [t for t, _ in entry.top] == best
        assert [lp for _, lp in entry.top] == pytest.approx([ref[t].item() for t in best], abs=1e-4)
        assert entry.top[0][0] == entry.token_id  # greedy
    assert [e.token_id for e in streamed] == expected and all(e.top == [] for e in streamed)


async def test_frequency_and_presence_penalties_match_a_reference(served):
    folder, svc = served
    prompt = [5, 5, 5, 5]

    def penalize(tokens, logits):
        generated = tokens[len(prompt):].tolist()
        for t in set(generated):
            logits[:, t] = logits[:, t] - 0.8 * generated.count(t) - 0.5
        return logits

    expected, _ = _reference(folder, prompt, 24, penalize)
    async with Client(svc.address, timeout_s=60) as client:
        result, plain = await asyncio.gather(
            client.generate(token_ids=prompt, max_tokens=24, ignore_eos=True, frequency_penalty=0.8, presence_penalty=0.5),
            client.generate(token_ids=prompt, max_tokens=24, ignore_eos=True),
        )
    assert result.token_ids == expected
    assert plain.token_ids == reference_greedy(folder, prompt, 24) != expected


async def test_repetition_penalty_matches_a_reference(served):
    folder, svc = served

    def penalize(tokens, logits):
        for t in set(tokens[len(PROMPT):].tolist()):
            v = logits[:, t]
            logits[:, t] = mx.where(v < 0, v * 1.7, v / 1.7)
        return logits

    expected, _ = _reference(folder, PROMPT, 24, penalize)
    async with Client(svc.address, timeout_s=60) as client:
        result = await client.generate(token_ids=PROMPT, max_tokens=24, ignore_eos=True, repetition_penalty=1.7)
    assert result.token_ids == expected


@pytest.fixture(scope="module")
def adder(tmp_path_factory):
    """The embedded adder model: its text is clean, one character per token ("123+456=" -> "579")."""
    folder = REPO / "models" / "adder"
    with running_service(tmp_path_factory.mktemp("adder"), folder, "[scheduler]\nmax_context = 64\n") as svc:
        yield folder, svc


async def test_stop_strings_across_token_boundaries(adder):
    folder, svc = adder
    async with Client(svc.address, timeout_s=60) as client:
        plain = await client.generate("123+456=", max_tokens=8)
        assert plain.text == "579"  # the model's own answer, one token per digit
        result = await client.generate("123+456=", max_tokens=8, stop=["never-there", "79"])
        chunks = [c.text async for c in client.stream("123+456=", max_tokens=8, stop="79")]
        released = [c.text async for c in client.stream("123+456=", max_tokens=8, stop="7x")]
        early = await client.generate("123+456=", max_tokens=8, stop="57")
    assert result.finish_reason == "stop" and result.stop_reason == "79"
    assert result.text == "5" and len(result.token_ids) == 3  # ended at the token that completed "79"
    assert "".join(chunks) == "5" and not any("7" in c for c in chunks)  # "7" was held back, then cut
    assert "".join(released) == "579"  # held back while it could start "7x", then sent
    assert early.text == "" and early.stop_reason == "57"


async def test_stop_token_ids_and_min_tokens(served):
    folder, svc = served
    greedy = reference_greedy(folder, PROMPT, 12)
    first = greedy[0]
    async with Client(svc.address, timeout_s=60) as client:
        stopped = await client.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True, stop_token_ids=[first])
        held = await client.generate(token_ids=PROMPT, max_tokens=12, ignore_eos=True, stop_token_ids=[first],
                                     min_tokens=4)
    assert stopped.token_ids == [first] and stopped.finish_reason == "stop" and stopped.stop_reason == first
    assert first not in held.token_ids[:4]


async def test_min_tokens_holds_back_eos(served):
    folder, svc = served
    eos = AutoTokenizer.from_pretrained(folder).eos_token_id
    force_eos = {eos: 100.0}  # EOS is the argmax at every position
    async with Client(svc.address, timeout_s=60) as client:
        at_once = await client.generate(token_ids=PROMPT, max_tokens=12, logit_bias=force_eos)
        held = await client.generate(token_ids=PROMPT, max_tokens=12, logit_bias=force_eos, min_tokens=3)
    assert at_once.token_ids == [eos] and at_once.finish_reason == "stop" and at_once.stop_reason is None
    assert eos not in held.token_ids[:3] and held.token_ids[3] == eos and len(held.token_ids) == 4
    assert held.finish_reason == "stop" and held.stop_reason is None  # EOS is not a stop token the request named


async def test_chat_applies_the_template(served):
    folder, svc = served
    tok = AutoTokenizer.from_pretrained(folder)
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "1+1="}]
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=False)
    async with Client(svc.address, timeout_s=60) as client:
        result = await client.chat(messages, max_tokens=6, ignore_eos=True)
        streamed = []
        async for chunk in client.stream(messages=messages, max_tokens=6, ignore_eos=True):
            streamed.extend(chunk.token_ids)
    assert result.prompt_tokens == len(ids)
    assert result.token_ids == streamed == reference_greedy(folder, ids, 6)


@pytest.mark.parametrize(
    "kwargs, needle",
    [
        (dict(top_p=0.0), "top_p"),
        (dict(top_k=-1), "top_k"),
        (dict(min_p=1.5), "min_p"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(presence_penalty=2.5), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(logit_bias={99999: 1.0}), "logit_bias"),
        (dict(logit_bias={3: 101.0}), "logit_bias"),
        (dict(seed=-1), "seed"),
        (dict(min_tokens=-2), "min_tokens"),
        (dict(stop=[""]), "stop"),
        (dict(logprobs=True, top_logprobs=21), "top_logprobs"),
        (dict(top_logprobs=2), "top_logprobs"),
        (dict(stop_token_ids=[100000]), "stop_token_ids"),
    ],
)
async def test_invalid_parameters_are_refused_by_name(served, kwargs, needle):
    _, svc = served
    async with Client(svc.address, timeout_s=60) as client:
        bad = await client.generate(token_ids=PROMPT, max_tokens=4, **kwargs)
        status = await client.status()
    assert bad.finish_reason == "error" and needle in bad.error
    assert status.running == 0


async def test_unknown_keywords_raise_in_the_client(served):
    _, svc = served
    async with Client(svc.address, timeout_s=60) as client:
        with pytest.raises(TypeError, match="top_q"):
            await client.generate(token_ids=PROMPT, top_q=0.5)
