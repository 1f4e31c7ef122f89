"""Request limits and validation at the edge: clear messages a person can act on."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    """What the worker reported it can hold, plus batching knobs."""

    num_slots: int
    max_rows: int
    max_context: int
    vocab_size: int
    max_step_tokens: int = 512
    prefill_chunk: int = 256
    cache_enabled: bool = True
    aux_slots: int = 0
    track_chunk: int = 64


class RequestRejected(ValueError):
    """The request can never be served; the message says why."""


def validate_request(
    lim: Limits, pool_capacity: int, prompt_ids: list[int], max_tokens: int, temperature: float
) -> int:
    """Check a request against the limits; return its effective max new tokens."""
    if not prompt_ids:
        raise RequestRejected("the prompt is empty: send at least one token")
    bad = [t for t in prompt_ids if not 0 <= t < lim.vocab_size]
    if bad:
        raise RequestRejected(f"unknown token ids {bad[:5]}: the vocabulary has ids 0..{lim.vocab_size - 1}")
    if max_tokens < 1:
        raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}")
    if temperature < 0:
        raise RequestRejected(f"temperature must be >= 0, got {temperature}")
    n = len(prompt_ids)
    if n >= lim.max_context:
        raise RequestRejected(
            f"the prompt has {n} tokens; this service's context holds at most {lim.max_context - 1} prompt tokens"
        )
    max_new = min(max_tokens, lim.max_context - n)
    if n + max_new > pool_capacity:
        raise RequestRejected(
            f"prompt ({n} tokens) plus max_tokens ({max_new}) exceeds the KV pool of {pool_capacity} "
            f"tokens; lower max_tokens or raise cache.kv_slots"
        )
    return max_new
