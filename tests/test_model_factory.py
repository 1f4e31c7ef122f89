"""Tests for tests/model_factory.py: tiny random models of real mlx-lm archs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

import mlx.core as mx  # noqa: E402
import model_factory as mf  # noqa: E402
from mlx_lm import load  # noqa: E402

PROMPT = "The quick brown fox jumps over the lazy dog."


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("tok")
    mf.build_tokenizer(d)
    return d


def test_tokenizer_loads_and_round_trips(tok_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(tok_dir))
    assert len(tok) == 256
    assert tok.eos_token == mf.EOS_TOKEN and tok.pad_token == mf.PAD_TOKEN
    assert tok.eos_token_id == mf.tokenizer_eos_id(tok_dir) == 0
    assert tok.pad_token_id == 1
    for text in [
        PROMPT,
        " leading space and trailing  ",
        "ünïcødé 日本語 🤖 emoji\n\ttabs\x00nul",
        "",
    ]:
        ids = tok.encode(text, add_special_tokens=False)
        assert all(0 <= i < 256 for i in ids)
        assert tok.decode(ids) == text
    # Specials are single tokens.
    assert tok.encode(mf.EOS_TOKEN, add_special_tokens=False) == [0]
    # Merges are actually learned (common English compresses below 1 byte/token).
    assert len(tok.encode(PROMPT, add_special_tokens=False)) < len(PROMPT.encode())


def test_tokenizer_larger_vocab(tmp_path):
    from transformers import AutoTokenizer

    mf.build_tokenizer(tmp_path, vocab_size=512)
    tok = AutoTokenizer.from_pretrained(str(tmp_path))
    assert 258 < len(tok) <= 512
    text = "bytes \xc0 and \xff: ÿÀ"
    assert tok.decode(tok.encode(text, add_special_tokens=False)) == text


def _greedy(folder: Path, n: int = 20) -> tuple[list[int], list[int]]:
    model, tok = load(str(folder))
    ids = tok.encode(PROMPT)
    return ids, mf.greedy_tokens(model, ids, n)


@pytest.mark.parametrize("arch", mf.ARCHS)
def test_arch_loads_and_generates(arch, model_dir):
    folder = model_dir(arch)  # built once per session, shared with the exactness tests

    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["model_type"] == arch
    assert cfg["eos_token_id"] == mf.tokenizer_eos_id(folder)
    vocab = mf._CONFIGS[arch]().get("vocab_size", 256)  # 256 but where a family needs its real size
    assert cfg["vocab_size"] == vocab
    for name in ("model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).exists()

    prompt_ids, out1 = _greedy(folder)
    assert len(out1) == 20
    assert len(set(out1)) >= 3, out1
    assert all(0 <= t < vocab for t in out1)

    # A second, independent load gives the same tokens ...
    _, out2 = _greedy(folder)
    assert out1 == out2
    # ... and so does the cached reference helper.
    assert mf.reference_greedy(folder, prompt_ids, 20) == out1
    assert mf.reference_greedy(folder, prompt_ids, 5) == out1[:5]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_deterministic_and_seeded(arch, tmp_path):
    a = mf.make_model(arch, tmp_path / "a", seed=7)
    b = mf.make_model(arch, tmp_path / "b", seed=7)
    c = mf.make_model(arch, tmp_path / "c", seed=8)
    wa, wb, wc = (mx.load(str(f / "model.safetensors")) for f in (a, b, c))
    assert set(wa) == set(wb) == set(wc)
    assert all(mx.array_equal(wa[k], wb[k]) for k in wa)
    assert not all(mx.array_equal(wa[k], wc[k]) for k in wa)
    assert (a / "tokenizer.json").read_bytes() == (b / "tokenizer.json").read_bytes()


@pytest.mark.parametrize("arch", ["llama", "qwen3_next"])
def test_bfloat16(arch, tmp_path):
    folder = mf.make_model(arch, tmp_path / arch, dtype="bfloat16")
    w = mx.load(str(folder / "model.safetensors"))
    assert all(v.dtype == mx.bfloat16 for v in w.values())
    model, tok = load(str(folder))
    out = mf.greedy_tokens(model, tok.encode(PROMPT), 20)
    assert len(set(out)) >= 3


def test_overrides(tmp_path):
    folder = mf.make_model("llama", tmp_path / "m", num_hidden_layers=3, tie_word_embeddings=True)
    assert folder == tmp_path / "m"
    cfg = json.loads((folder / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["tie_word_embeddings"] is True
    w = mx.load(str(folder / "model.safetensors"))
    assert "lm_head.weight" not in w
    assert any(k.startswith("model.layers.2.") for k in w)
    model, tok = load(str(folder))
    assert len(set(mf.greedy_tokens(model, tok.encode(PROMPT), 20))) >= 3

    nested = mf.make_model("qwen3_5", tmp_path / "q", num_hidden_layers=2)
    cfg = json.loads((nested / "config.json").read_text())
    assert cfg["text_config"]["num_hidden_layers"] == 2
    load(str(nested))


def test_unknown_arch(tmp_path):
    with pytest.raises(ValueError):
        mf.make_model("not_an_arch", tmp_path)
