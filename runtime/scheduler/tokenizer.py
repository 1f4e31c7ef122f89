"""Tokenizer and incremental detokenizer, loaded from the model folder (no mlx)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any


def _as_ids(value: Any) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


class Tokenizer:
    """Wraps the model folder's Hugging Face tokenizer; EOS ids as mlx-lm collects them."""

    def __init__(self, path: str) -> None:
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
        from transformers import AutoTokenizer

        self._tok = AutoTokenizer.from_pretrained(path)
        eos = _as_ids(self._tok.eos_token_id)
        for name in ("config.json", "generation_config.json"):
            file = Path(path) / name
            if file.exists():
                data = json.loads(file.read_text())
                eos |= _as_ids(data.get("eos_token_id"))
                eos |= _as_ids(data.get("text_config", {}).get("eos_token_id"))
        self.eos_ids = frozenset(eos)

    @property
    def hf(self) -> Any:
        """The transformers tokenizer (chat templates: ``runtime/scheduler/chat.py``)."""
        return self._tok

    @property
    def backend(self) -> Any:
        """The Rust `tokenizers.Tokenizer` behind a fast tokenizer, or None."""
        return getattr(self._tok, "backend_tokenizer", None)

    def encode(self, text: str) -> list[int]:
        return list(self._tok.encode(text))

    def decode(self, ids: list[int]) -> str:
        return self._tok.decode(ids, skip_special_tokens=True)


class Detokenizer:
    """Turns a growing list of token ids into text deltas without re-decoding everything.

    Holds back text ending in an incomplete UTF-8 sequence (U+FFFD) until it completes.
    """

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        # The text so far, in deltas: appending to one growing string would copy all of it
        # at every token of a long stream.
        self._pieces: list[str] = []
        self._stream = None
        self._backend = tokenizer.backend
        if self._backend is not None:
            from tokenizers.decoders import DecodeStream

            # The tokenizers library's own incremental decoder: a few µs per token.
            self._stream = DecodeStream(skip_special_tokens=True)

    def add(self, new_ids: list[int]) -> str:
        """Append tokens; return the newly completed text."""
        if self._stream is not None:
            self.ids.extend(new_ids)
            if len(new_ids) == 1:  # a decode step's token
                delta = self._stream.step(self._backend, new_ids[0]) or ""
            else:
                delta = "".join(self._stream.step(self._backend, token) or "" for token in new_ids)
            self._pieces.append(delta)
            return delta
        self.ids.extend(new_ids)
        prefix_text = self.tokenizer.decode(self.ids[self.prefix_offset : self.read_offset])
        full_text = self.tokenizer.decode(self.ids[self.prefix_offset :])
        if full_text.endswith("\ufffd") or len(full_text) <= len(prefix_text):
            return ""
        delta = full_text[len(prefix_text) :]
        self.prefix_offset = self.read_offset
        self.read_offset = len(self.ids)
        self._pieces.append(delta)
        return delta

    @property
    def text(self) -> str:
        """Every delta returned so far, joined."""
        if len(self._pieces) > 1:
            self._pieces = ["".join(self._pieces)]
        return self._pieces[0] if self._pieces else ""

    def flush(self) -> str:
        """Whatever is held back, at the end of the request."""
        full = self.tokenizer.decode(self.ids)
        text = self.text
        delta = full[len(text) :] if full.startswith(text) else ""
        self._pieces.append(delta)
        return delta
