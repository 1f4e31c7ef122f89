"""Token text for logprobs, from the model folder's tokenizer (transformers, no mlx)."""

from __future__ import annotations

import functools
import os


class TokenText:
    """Decodes single token ids to text (memoised); a partial UTF-8 token decodes to U+FFFD.

    The tokenizer loads on the first request that needs it (logprobs, chat markup), so start-up stays fast.
    """

    def __init__(self, model_path: str) -> None:
        self._path = model_path
        self._tok = None
        self.of = functools.lru_cache(maxsize=65536)(self._decode)

    @property
    def tokenizer(self):
        """The folder's transformers tokenizer, loaded on first use."""
        if self._tok is None:
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
            from transformers import AutoTokenizer

            self._tok = AutoTokenizer.from_pretrained(self._path)
        return self._tok

    def _decode(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id])
