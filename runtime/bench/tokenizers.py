"""Tokenizers for synthetic bench models: a word-level one (the bench sends token ids) and a
byte-level BPE one (structured output needs every text expressible)."""

from __future__ import annotations

import json
from pathlib import Path

EOS_TOKEN = "<eos>"


def write_tokenizer(folder: Path, vocab_size: int) -> None:
    """A WordLevel tokenizer: ids 0..V-2 are ``t0``.., id V-1 is the EOS token.

    The bench sends token ids only; the tokenizer just has to load with
    ``transformers.AutoTokenizer`` and decode ids.
    """
    vocab = {f"t{i}": i for i in range(vocab_size - 1)}
    vocab[EOS_TOKEN] = vocab_size - 1
    tok = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": [
            {
                "id": vocab_size - 1,
                "content": EOS_TOKEN,
                "single_word": False,
                "lstrip": False,
                "rstrip": False,
                "normalized": False,
                "special": True,
            }
        ],
        "normalizer": None,
        "pre_tokenizer": {"type": "WhitespaceSplit"},
        "post_processor": None,
        "decoder": None,
        "model": {"type": "WordLevel", "vocab": vocab, "unk_token": EOS_TOKEN},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    _write_tokenizer_config(folder)


def _write_tokenizer_config(folder: Path) -> None:
    tok_cfg = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": EOS_TOKEN,
        "unk_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "bos_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 131072,
    }
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=2))


def _byte_chars() -> dict[int, str]:
    """Byte-level BPE's printable stand-in for each byte (printable bytes stand for themselves)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def write_byte_tokenizer(folder: Path, vocab_size: int) -> None:
    """A byte-level BPE tokenizer without merges: ids 0..255 are the bytes, ids up to V-2 are
    fillers ``<i>`` (never produced by encoding), id V-1 is the EOS token.

    For workloads that need every text to be expressible and the tokens' bytes known, such as
    structured output (llguidance reads byte-level tokenizers, not word-level ones).
    """
    chars = _byte_chars()
    vocab = {chars[b]: b for b in range(256)}
    vocab.update({f"<{i}>": i for i in range(256, vocab_size - 1)})
    vocab[EOS_TOKEN] = vocab_size - 1
    level = {"add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tok = {
        "version": "1.0", "truncation": None, "padding": None,
        "added_tokens": [{"id": vocab_size - 1, "content": EOS_TOKEN, "single_word": False, "lstrip": False,
                          "rstrip": False, "normalized": False, "special": True}],
        "normalizer": None,
        "pre_tokenizer": {"type": "ByteLevel", **level},
        "post_processor": None,
        "decoder": {"type": "ByteLevel", **level},
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False, "vocab": vocab,
                  "merges": []},
    }
    (folder / "tokenizer.json").write_text(json.dumps(tok), encoding="utf-8")
    _write_tokenizer_config(folder)
