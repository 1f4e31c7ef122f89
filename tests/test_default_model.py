"""The embedded default model (models/adder, made by scripts/train_adder.py)
loads with mlx-lm and adds integers with greedy decoding."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

ADDER = Path(__file__).resolve().parent.parent / "models" / "adder"


def _problems(n: int, seed: int = 20261129) -> list[tuple[int, int]]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        pair = []
        for _ in range(2):
            digits = rng.randint(1, 3)
            lo = 0 if digits == 1 else 10 ** (digits - 1)
            pair.append(rng.randrange(lo, 10**digits))
        out.append(tuple(pair))
    return out


@pytest.fixture(scope="module")
def adder():
    from mlx_lm import load

    return load(str(ADDER))


def _greedy_answer(model, tokenizer, prompt: str, max_tokens: int = 8) -> str | None:
    """Greedy continuation up to EOS (None if no EOS within max_tokens)."""
    import mlx.core as mx
    from mlx_lm.generate import generate_step
    from mlx_lm.sample_utils import make_sampler

    ids = tokenizer.encode(prompt)
    out = []
    for tok, _ in generate_step(
        mx.array(ids), model, max_tokens=max_tokens, sampler=make_sampler(temp=0.0)
    ):
        if tok in tokenizer.eos_token_ids:
            return tokenizer.decode(out)
        out.append(tok)
    return None


def test_folder_layout_and_tokenizer(adder):
    _, tokenizer = adder
    config = json.loads((ADDER / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert tokenizer.eos_token_ids == {config["eos_token_id"]}
    assert tokenizer.convert_ids_to_tokens(config["eos_token_id"]) == "</s>"
    # one token per character, no BOS/EOS added on encode
    ids = tokenizer.encode("123+45=")
    assert len(ids) == 7 and config["bos_token_id"] not in ids
    assert tokenizer.decode(tokenizer.encode("1998")) == "1998"


def test_greedy_addition(adder):
    model, tokenizer = adder
    problems = _problems(20)
    answers = {f"{a}+{b}=": _greedy_answer(model, tokenizer, f"{a}+{b}=") for a, b in problems}
    wrong = {p: got for (a, b), (p, got) in zip(problems, answers.items()) if got != str(a + b)}
    assert len(wrong) <= 1, f"wrong answers: {wrong}"


def test_known_sums(adder):
    model, tokenizer = adder
    assert _greedy_answer(model, tokenizer, "123+45=") == "168"
    assert _greedy_answer(model, tokenizer, "999+999=") == "1998"
    assert _greedy_answer(model, tokenizer, "0+0=") == "0"
