"""Request limits and validation at the edge: clear messages a person can act on."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.config import Config
    from runtime.protocol.worker import Ready

MIN_TEMPERATURE = 1e-5
"""Temperatures in (0, MIN_TEMPERATURE) are greedy: 1/t would overflow the logits' dtype."""

MAX_TEMPERATURE = 1e4


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

    @classmethod
    def for_worker(cls, ready: Ready, config: Config) -> Limits:
        """What a worker reported it holds and runs with, with the config's cache knobs."""
        c = config.cache
        return cls(
            num_slots=ready.num_slots, max_rows=ready.max_rows, max_context=ready.max_context,
            vocab_size=ready.vocab_size, max_step_tokens=ready.max_step_tokens, prefill_chunk=ready.prefill_chunk,
            cache_enabled=c.enabled, aux_slots=ready.aux_slots, track_chunk=c.track_chunk,
        )


class RequestRejected(ValueError):
    """The request can never be served; the message says why."""


def validate_request(
    lim: Limits, pool_capacity: int, prompt_ids: list[int], max_tokens: int, temperature: float
) -> int:
    """Check a request against the limits; return its effective max new tokens."""
    if not prompt_ids:
        raise RequestRejected("the prompt is empty: send at least one token")
    if max_tokens < 1:
        raise RequestRejected(f"max_tokens must be at least 1, got {max_tokens}")
    checked_temperature(temperature)
    n = len(prompt_ids)
    if n >= lim.max_context:  # before the scan below: a huge prompt costs nothing more
        raise RequestRejected(
            f"the prompt has {n} tokens; this service's context holds at most {lim.max_context - 1} prompt tokens"
        )
    if min(prompt_ids) < 0 or max(prompt_ids) >= lim.vocab_size:
        bad = [t for t in prompt_ids if not 0 <= t < lim.vocab_size]
        raise RequestRejected(f"unknown token ids {bad[:5]}: the vocabulary has ids 0..{lim.vocab_size - 1}")
    max_new = min(max_tokens, lim.max_context - n)
    if n + max_new > pool_capacity:
        raise RequestRejected(
            f"prompt ({n} tokens) plus max_tokens ({max_new}) exceeds the KV pool of {pool_capacity} "
            f"tokens; lower max_tokens or raise cache.kv_slots"
        )
    return max_new


def checked_temperature(temperature: float) -> float:
    """The temperature a request samples at: finite, 0 (greedy) or in [1e-5, 1e4]."""
    if not math.isfinite(temperature):
        raise RequestRejected(f"temperature must be a finite number, got {temperature}")
    if temperature < 0:
        raise RequestRejected(f"temperature must be >= 0, got {temperature}")
    if temperature > MAX_TEMPERATURE:
        raise RequestRejected(f"temperature must be at most {MAX_TEMPERATURE:g}, got {temperature}")
    return 0.0 if temperature < MIN_TEMPERATURE else temperature
