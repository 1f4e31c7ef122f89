"""From a client's Generate message to prompt token ids, without stalling the event loop."""

from __future__ import annotations

import asyncio
import dataclasses
import secrets
from concurrent.futures import ThreadPoolExecutor

import msgspec

from runtime.protocol import client as cp
from runtime.scheduler.admission import RequestRejected
from runtime.scheduler.chat import chat_prompt_ids, system_prefix_len
from runtime.scheduler.params import check_prompt_logprobs, check_sampling
from runtime.scheduler.request import SamplingParams
from runtime.scheduler.tokenizer import Tokenizer

INLINE_TOKENIZE_BYTES = 4096
"""Prompts up to this size are tokenized on the loop (faster than a thread hop)."""
PROMPT_BYTES_PER_TOKEN = 32
"""A prompt text longer than this many bytes per token of context is refused untokenized."""


class Intake:
    """Tokenizes prompts: short ones inline, long ones on one background thread, in order."""

    def __init__(self, tokenizer: Tokenizer, max_context: int) -> None:
        self.tokenizer = tokenizer
        self.max_prompt_bytes = max(65536, max_context * PROMPT_BYTES_PER_TOKEN)
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tokenize")

    def set_max_context(self, max_context: int) -> None:
        self.max_prompt_bytes = max(65536, max_context * PROMPT_BYTES_PER_TOKEN)

    @staticmethod
    def needs_thread(msg: cp.Generate) -> bool:
        """Whether the prompt is text long enough to tokenize off the loop (a cheap upper bound)."""
        if msg.messages is not None:
            return True  # a template may print any field: render it off the loop
        return msg.prompt is not None and len(msg.prompt) * 4 > INLINE_TOKENIZE_BYTES

    def prompt_ids_now(self, msg: cp.Generate) -> list[int]:
        """The prompt as token ids, on the calling thread; raises RequestRejected with a reason."""
        given = sum(x is not None for x in (msg.prompt, msg.token_ids, msg.messages))
        if given != 1:
            raise RequestRejected("give exactly one of prompt, token_ids or messages")
        if msg.token_ids is not None:
            return list(msg.token_ids)
        if msg.messages is not None:
            self._checked_chat(msg)
            return self._chat(msg)
        assert msg.prompt is not None
        return self._encode(self._checked_text(msg.prompt))

    async def prompt_ids(self, msg: cp.Generate) -> list[int]:
        """``prompt_ids_now`` on the tokenizer thread."""
        if msg.messages is not None and msg.prompt is None and msg.token_ids is None:
            self._checked_chat(msg)
            return await asyncio.get_running_loop().run_in_executor(self._pool, self._chat, msg)
        if msg.prompt is None or msg.token_ids is not None or msg.messages is not None:
            return self.prompt_ids_now(msg)
        text = self._checked_text(msg.prompt)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._encode, text)

    def _chat(self, msg: cp.Generate) -> list[int]:
        return chat_prompt_ids(self.tokenizer.hf, msg.messages or [], msg.chat_template_kwargs, msg.tools)

    async def shared_prefix(self, msg: cp.Generate, ids: list[int]) -> int:
        """How many of a chat request's ``ids`` are its system message (``system_prefix_len``),
        on the tokenizer thread; 0 for other requests."""
        if msg.messages is None:
            return 0
        return await asyncio.get_running_loop().run_in_executor(
            self._pool, system_prefix_len, self.tokenizer.hf, msg.messages, ids, msg.chat_template_kwargs, msg.tools)

    def _checked_chat(self, msg: cp.Generate) -> None:
        """Everything a chat template may print counts against the prompt's byte limit."""
        try:
            size = len(msgspec.json.encode([msg.messages, msg.tools, msg.chat_template_kwargs]))
        except Exception as exc:  # e.g. values JSON cannot hold
            raise RequestRejected(f"the chat messages cannot be read: {exc}") from None
        if size > self.max_prompt_bytes:
            raise RequestRejected(
                f"the chat messages are {size} bytes; this service takes at most {self.max_prompt_bytes} "
                f"({PROMPT_BYTES_PER_TOKEN} per token of context)"
            )

    def _checked_text(self, text: str) -> str:
        size = len(text.encode("utf-8", errors="surrogatepass"))
        if size > self.max_prompt_bytes:
            raise RequestRejected(
                f"the prompt text is {size} bytes; this service takes at most {self.max_prompt_bytes} "
                f"({PROMPT_BYTES_PER_TOKEN} per token of context)"
            )
        return text

    def _encode(self, text: str) -> list[int]:
        try:
            return self.tokenizer.encode(text)
        except Exception as exc:  # e.g. lone surrogates the tokenizer cannot take
            raise RequestRejected(f"the prompt text cannot be tokenized: {exc}") from None

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)



def sampling_params(msg: cp.Generate, vocab_size: int) -> SamplingParams:
    """The request's validated parameters; raises RequestRejected naming the bad one.

    A request without a seed gets a random one: sampling is random per request, and each
    row's draws still come from its own seed (batch-invariant).
    """
    choice = check_sampling(
        temperature=msg.temperature, top_p=msg.top_p, top_k=msg.top_k, min_p=msg.min_p,
        repetition_penalty=msg.repetition_penalty, presence_penalty=msg.presence_penalty,
        frequency_penalty=msg.frequency_penalty, logit_bias=msg.logit_bias, seed=msg.seed,
        min_tokens=msg.min_tokens, stop=msg.stop, logprobs=msg.logprobs, top_logprobs=msg.top_logprobs,
        vocab_size=vocab_size,
    )
    if any(not 0 <= t < vocab_size for t in msg.stop_token_ids):
        raise RequestRejected(f"stop_token_ids must be token ids in 0..{vocab_size - 1}")
    seed = choice.seed if choice.seed is not None else secrets.randbits(64)
    return SamplingParams(
        **{**dataclasses.asdict(choice), "seed": seed},
        max_tokens=msg.max_tokens,
        ignore_eos=msg.ignore_eos,
        stop_token_ids=frozenset(msg.stop_token_ids),
        prompt_logprobs=check_prompt_logprobs(msg.prompt_logprobs),
    )
