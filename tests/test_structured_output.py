"""Structured output through the real service: JSON schema, regex, Lark grammars and JSON objects,
each row constrained by its own grammar inside batches whose other rows stay token-exact."""

from __future__ import annotations

import asyncio
import json
import re

import mlx.core as mx
import numpy as np
import pytest
from conftest import running_service
from model_factory import reference_greedy

from runtime.client import Client
from runtime.protocol.client import Generate
from runtime.scheduler.admission import RequestRejected
from runtime.scheduler.grammar import grammar_spec
from runtime.worker.sampler import grammar_allowed

EXTRA = "[cache]\nkv_slots = 8192\n[scheduler]\nmax_running = 24\nmax_context = 512\n"
SCHEMA = {
    "type": "object",
    "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"}},
    "required": ["color", "ok"],
    "additionalProperties": False,
}
PATTERN = r"[a-z]{3,6}-[0-9]{2}"


@pytest.fixture(scope="module")
def served(model_dir, tmp_path_factory):
    folder = model_dir("llama")
    with running_service(tmp_path_factory.mktemp("svc"), folder, EXTRA) as svc:
        yield folder, svc


def _valid(text: str) -> bool:
    value = json.loads(text)
    return set(value) == {"color", "ok"} and value["color"] in ("red", "green", "blue") and isinstance(value["ok"], bool)


def test_mask_bits_are_little_endian_words():
    words = np.zeros((2, 2), dtype="<u4")
    words[0, 0] = 1 << 3  # token 3
    words[1, 1] = 1 << 4  # token 36
    allowed = grammar_allowed([words[0].tobytes(), words[1].tobytes()], 70)
    assert allowed.shape == (2, 70)
    assert np.flatnonzero(np.array(allowed[0])).tolist() == [3]
    assert np.flatnonzero(np.array(allowed[1])).tolist() == [36]  # tokens 64-69: past the mask, never allowed


def test_grammar_fields_are_checked_at_the_edge():
    with pytest.raises(RequestRejected, match="at most one of"):
        grammar_spec(Generate(rid="a", prompt="x", regex="a", json_object=True))
    with pytest.raises(RequestRejected, match="invalid regex"):
        grammar_spec(Generate(rid="a", prompt="x", regex="a(b"))
    with pytest.raises(RequestRejected, match="invalid grammar"):
        grammar_spec(Generate(rid="a", prompt="x", grammar="start: ("))
    assert grammar_spec(Generate(rid="a", prompt="x")) is None
    assert grammar_spec(Generate(rid="a", prompt="x", grammar='start: "a" | "b"')).kind == "grammar"


async def test_constrained_rows_parse_and_other_rows_stay_exact(served):
    folder, svc = served
    plain_prompts = [[9, 4, i + 1] for i in range(6)]
    async with Client(svc.address, timeout_s=120) as client:
        constrained = [
            client.generate(token_ids=[5, 6, i + 2], max_tokens=60, json_schema=SCHEMA, temperature=t, seed=i)
            for i, t in enumerate([0.0, 1.0, 1.0, 1.5, 0.7, 1.0, 1.0, 1.2])
        ]
        regexes = [client.generate(token_ids=[7, i + 3], max_tokens=40, regex=PATTERN, temperature=1.0, seed=100 + i)
                   for i in range(6)]
        objects = [client.generate(token_ids=[8, i + 3], max_tokens=120, json_object=True, temperature=0.0)
                   for i in range(2)]
        plain = [client.generate(token_ids=p, max_tokens=20, ignore_eos=True) for p in plain_prompts]
        results = await asyncio.gather(*constrained, *regexes, *objects, *plain)
    n_c, n_r, n_o = len(constrained), len(regexes), len(objects)
    for r in results[:n_c]:
        assert r.finish_reason == "stop", (r.finish_reason, r.text, r.error)
        assert _valid(r.text), r.text
    for r in results[n_c:n_c + n_r]:
        assert r.finish_reason == "stop", (r.finish_reason, r.text)
        assert re.fullmatch(PATTERN, r.text), r.text
    for r in results[n_c + n_r:n_c + n_r + n_o]:
        if r.finish_reason == "stop":  # an object may also run out of max_tokens: then it is "length"
            assert isinstance(json.loads(r.text), dict), r.text
        else:
            assert r.finish_reason == "length"
    for prompt, r in zip(plain_prompts, results[n_c + n_r + n_o:]):
        assert r.token_ids == reference_greedy(folder, prompt, 20)


async def test_seeded_constrained_output_is_batch_invariant_and_streams(served):
    _, svc = served
    kw = dict(token_ids=[5, 6, 7], max_tokens=60, json_schema=SCHEMA, temperature=1.0, seed=42)
    async with Client(svc.address, timeout_s=120) as client:
        alone = await client.generate(**kw)
        crowd = [client.generate(token_ids=[3, i + 1], max_tokens=30, ignore_eos=True, temperature=1.0) for i in range(6)]
        together = (await asyncio.gather(client.generate(**kw), *crowd))[0]
        streamed = ""
        async for chunk in client.stream(**kw):
            streamed += chunk.text
    assert together.token_ids == alone.token_ids and _valid(alone.text)
    assert streamed == alone.text


async def test_grammar_that_cannot_finish_ends_with_length_and_bad_ones_are_refused(served):
    _, svc = served
    async with Client(svc.address, timeout_s=60) as client:
        long = await client.generate(token_ids=[5, 6], max_tokens=5, regex=r"[a-z]{20}")
        assert long.finish_reason == "length" and len(long.token_ids) == 5
        assert re.fullmatch(r"[a-z]{5,19}", long.text), long.text  # a prefix of a valid output
        lark = await client.generate(token_ids=[5, 6], max_tokens=20, grammar='start: "yes" | "no"')
        assert lark.finish_reason == "stop" and lark.text in ("yes", "no")
        gbnf = await client.generate(token_ids=[5, 6], max_tokens=20, grammar='root ::= "yes" | "no"')
        assert gbnf.finish_reason == "stop" and gbnf.text in ("yes", "no")  # GBNF, converted to Lark
        bad = await client.generate(token_ids=[5, 6], max_tokens=5, json_schema={"type": "object", "properties": 3})
        assert bad.finish_reason == "error" and "json_schema" in bad.error
        bad_regex = await client.generate(token_ids=[5, 6], max_tokens=5, regex="[a-")
        assert bad_regex.finish_reason == "error" and "regex" in bad_regex.error
        bad_grammar = await client.generate(token_ids=[5, 6], max_tokens=5, grammar="start: undefined_rule")
        assert bad_grammar.finish_reason == "error" and "grammar" in bad_grammar.error
        status = await client.status()
    assert status.running == 0
    assert status.mask_steps > 0 and status.mask_s > 0  # the constrained requests' masks, timed


def test_masked_greedy_takes_the_best_allowed_token():
    from runtime.protocol.worker import DecodeBatch
    from runtime.worker.sampler import RowSampler

    logits = mx.array(np.arange(64, dtype=np.float32)[None].repeat(2, axis=0))
    words = np.zeros(2, dtype="<u4")
    words[0] = (1 << 5) | (1 << 9)  # tokens 5 and 9 allowed in row 1
    batch = DecodeBatch(rows=[0, 1], token_ids=[1, 1], positions=[3, 3], slot_ids=[0, 0], temperatures=[0.0, 0.0],
                        mask_rows=[1], masks=[words.tobytes()])
    assert RowSampler(max_rows=2).sample(logits, batch).tokens.tolist() == [63, 9]


def test_a_tokenizer_llguidance_cannot_read_is_refused_clearly(tmp_path):
    from runtime.bench.tokenizers import write_tokenizer
    from runtime.scheduler.grammar import Grammars
    from runtime.scheduler.tokenizer import Tokenizer

    write_tokenizer(tmp_path, 50)  # word-level, no decoder: no token has known bytes
    grammars = Grammars(Tokenizer(str(tmp_path)), 50)
    spec = grammar_spec(Generate(rid="a", prompt="x", regex="[a-z]+"))
    with pytest.raises(RequestRejected, match="llguidance cannot read its tokenizer"):
        grammars.constraint(spec)


def test_the_benchs_byte_level_tokenizer_serves_grammars(tmp_path):
    from runtime.bench.tokenizers import write_byte_tokenizer
    from runtime.scheduler.grammar import Grammars
    from runtime.scheduler.tokenizer import Tokenizer

    write_byte_tokenizer(tmp_path, 400)
    tok = Tokenizer(str(tmp_path))
    text = '{"a": [1, 2]} héllo'
    assert tok.decode(tok.encode(text)) == text and tok.eos_ids == {399}
    mask = Grammars(tok, 400).constraint(grammar_spec(Generate(rid="a", prompt="x", regex="[a-z]+"))).mask()
    allowed = np.flatnonzero(np.unpackbits(np.frombuffer(mask, dtype=np.uint8), bitorder="little"))
    assert allowed.tolist() == list(range(ord("a"), ord("z") + 1))  # letters only: no filler, no EOS yet


def test_a_steps_masks_computed_together_equal_each_alone(tmp_path):
    from runtime.bench.tokenizers import write_byte_tokenizer
    from runtime.scheduler.grammar import Grammars, masks_of
    from runtime.scheduler.tokenizer import Tokenizer

    write_byte_tokenizer(tmp_path, 1000)
    grammars = Grammars(Tokenizer(str(tmp_path)), 1003)  # logits wider than the tokenizer, as real vocabs pad
    patterns = ["[a-z]+", "[0-9]{2,3}", "(yes|no)", "[a-c]"]
    cons = [grammars.constraint(grammar_spec(Generate(rid="a", prompt="x", regex=p))) for p in patterns]
    for c, text in zip(cons, ["ab", "1", "y", "b"]):
        for ch in text:
            assert c.advance(ord(ch)) is None
    assert cons[3].done  # a finished grammar allows every token
    alone = [c.mask() for c in cons]
    assert masks_of(cons) == alone and len({len(m) for m in alone}) == 1
    assert len(set(alone)) == 4


def test_a_constrained_row_decodes_every_step_with_its_mask_sent_after():
    """Scheduler alone: a constrained request chains like the others; the mask of a step whose
    input token is still in flight follows as Masks once that token is back."""
    from runtime.scheduler.admission import Limits
    from runtime.scheduler.core import Scheduler
    from runtime.scheduler.request import Request, SamplingParams

    class FakeConstraint:
        def __init__(self) -> None:
            self.seen: list[int] = []

        def mask(self) -> bytes:
            return bytes([len(self.seen)]) + bytes(3)  # one word; its first byte says how many tokens it saw

        def advance(self, token: int) -> None:
            self.seen.append(token)

        done = False

    s = Scheduler(Limits(256, 4, 128, 32), frozenset({0}), debug_invariants=True)
    fake = FakeConstraint()
    req = Request(rid="c", prompt_ids=[3, 4], params=SamplingParams(max_tokens=5, ignore_eos=True),
                  max_new=s.validate([3, 4], 5, 0.0), constraint=fake)
    s.add(req)
    first = s.next_step()  # prefill + first decode: the fresh grammar's mask goes inline
    assert first.step.decode.mask_rows == [0] and first.step.decode.masks == [bytes(4)]
    second = s.next_step()  # planned before the first token is back: chained, mask deferred
    assert second.step.decode.token_ids == [-1] and second.step.decode.deferred_rows == [0]
    assert s.take_masks() == []
    s.on_step_done(first.step.step_id, [7])
    (masks,) = s.take_masks()
    assert masks.step_id == second.step.step_id and masks.masks == [bytes([1]) + bytes(3)] and fake.seen == [7]
