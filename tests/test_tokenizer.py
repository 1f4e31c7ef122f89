"""Incremental detokenization equals a full decode, multi-byte characters included."""

from __future__ import annotations

import pytest

from runtime.scheduler.tokenizer import Detokenizer, Tokenizer

TEXTS = ["plain ascii words", "héllo wörld", "你好，世界", "emoji 😀🎉 end", " leading space"]


@pytest.mark.parametrize("use_stream", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_full_decode(model_dir, text, use_stream):
    tok = Tokenizer(str(model_dir("llama")))
    ids = tok.encode(text)
    detok = Detokenizer(tok)
    if not use_stream:
        detok._stream = None  # the offset-based fallback for tokenizers without a Rust backend
    pieces = [detok.add([i]) for i in ids]
    streamed = "".join(pieces) + detok.flush()
    assert streamed == tok.decode(ids) == text
    assert all("\ufffd" not in p for p in pieces)  # partial characters are held back


def test_eos_ids_collected_from_config(model_dir):
    tok = Tokenizer(str(model_dir("llama")))
    assert 0 in tok.eos_ids  # <|endoftext|> in the test tokenizer
