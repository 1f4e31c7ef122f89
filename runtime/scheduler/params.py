"""Sampling parameters checked at the edge: each refusal names the parameter and its range."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from typing import Any

from runtime.scheduler.admission import RequestRejected, checked_temperature

MAX_REPETITION_PENALTY = 10.0
MAX_ABS_PENALTY = 2.0
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_ENTRIES = 1024
MAX_TOP_LOGPROBS = 20
MAX_SEED = 2**64 - 1

_TOKEN_ID_TEXT = re.compile(r"[0-9]{1,20}")


@dataclass(frozen=True)
class SamplingChoice:
    """A request's validated sampling parameters; the "off" value of each is its default."""

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    min_tokens: int = 0
    stop: tuple[str, ...] = ()
    logprobs: bool = False
    top_logprobs: int = 0


def check_sampling(
    *,
    temperature: Any,
    top_p: Any,
    top_k: Any,
    min_p: Any,
    repetition_penalty: Any,
    presence_penalty: Any,
    frequency_penalty: Any,
    logit_bias: Any,
    seed: Any,
    min_tokens: Any,
    stop: Any,
    logprobs: Any,
    top_logprobs: Any,
    vocab_size: int,
    max_stop_strings: int = 16,
    max_stop_len: int = 256,
) -> SamplingChoice:
    """Validate a request's sampling parameters; raise RequestRejected naming the first bad one.

    `logit_bias` may be None or a dict whose keys are token ids as ints or as decimal strings
    (JSON object keys); `stop` may be None, a string or a list of strings; `logprobs` None
    means False and `top_logprobs` None means 0.
    """
    temperature_value = checked_temperature(_real("temperature", temperature))
    top_p_value = _real("top_p", top_p)
    if not 0.0 < top_p_value <= 1.0:
        raise RequestRejected(f"top_p must be in (0, 1] (1 = off), got {top_p_value}")
    min_p_value = _real("min_p", min_p)
    if not 0.0 <= min_p_value <= 1.0:
        raise RequestRejected(f"min_p must be in [0, 1] (0 = off), got {min_p_value}")
    top_k_value = _int("top_k", top_k)
    if top_k_value < 0:
        raise RequestRejected(f"top_k must be 0 (off) or at least 1, got {top_k_value}")
    rep = _real("repetition_penalty", repetition_penalty)
    if not 0.0 < rep <= MAX_REPETITION_PENALTY:
        raise RequestRejected(
            f"repetition_penalty must be in (0, {MAX_REPETITION_PENALTY:g}] (1 = off), got {rep}"
        )
    min_tokens_value = _int("min_tokens", min_tokens)
    if min_tokens_value < 0:
        raise RequestRejected(f"min_tokens must be >= 0, got {min_tokens_value}")
    logprobs_value = False if logprobs is None else logprobs
    if not isinstance(logprobs_value, bool):
        raise RequestRejected(f"logprobs must be true or false, got {_shown(logprobs)}")
    top_n = 0 if top_logprobs is None else _int("top_logprobs", top_logprobs)
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise RequestRejected(f"top_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_n}")
    if top_n > 0 and not logprobs_value:
        raise RequestRejected(f"top_logprobs ({top_n}) requires logprobs to be true")
    return SamplingChoice(
        temperature=temperature_value,
        top_p=top_p_value,
        top_k=top_k_value,
        min_p=min_p_value,
        repetition_penalty=rep,
        presence_penalty=_penalty("presence_penalty", presence_penalty),
        frequency_penalty=_penalty("frequency_penalty", frequency_penalty),
        logit_bias=_logit_bias(logit_bias, vocab_size),
        seed=_seed(seed),
        min_tokens=min_tokens_value,
        stop=_stop(stop, max_stop_strings, max_stop_len),
        logprobs=logprobs_value,
        top_logprobs=top_n,
    )


def check_prompt_logprobs(value: Any) -> int:
    """``prompt_logprobs``: None (off, -1) or the number of top logprobs per prompt token."""
    if value is None:
        return -1
    top_n = _int("prompt_logprobs", value)
    if not 0 <= top_n <= MAX_TOP_LOGPROBS:
        raise RequestRejected(f"prompt_logprobs must be in 0..{MAX_TOP_LOGPROBS}, got {top_n}")
    return top_n


def _real(name: str, value: Any) -> float:
    """A finite int or float (not a bool) as a float."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise RequestRejected(f"{name} must be a number, got {_shown(value)}")
    try:
        result = float(value)
    except OverflowError:  # an int beyond float range: refuse it like inf
        result = math.inf
    if not math.isfinite(result):
        raise RequestRejected(f"{name} must be a finite number, got {_shown(value)}")
    return result


def _shown(value: Any) -> str:
    """A value's repr cut to a length that fits in an error message."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _int(name: str, value: Any) -> int:
    """An int that is not a bool."""
    if isinstance(value, bool) or not isinstance(value, int):
        raise RequestRejected(f"{name} must be an integer, got {_shown(value)}")
    return value


def _penalty(name: str, value: Any) -> float:
    result = _real(name, value)
    if not -MAX_ABS_PENALTY <= result <= MAX_ABS_PENALTY:
        raise RequestRejected(f"{name} must be in [-2, 2] (0 = off), got {result}")
    return result


def _seed(seed: Any) -> int | None:
    if seed is None:
        return None
    value = _int("seed", seed)
    if not 0 <= value <= MAX_SEED:
        raise RequestRejected(f"seed must be in 0..2**64-1, got {value}")
    return value


def _logit_bias(logit_bias: Any, vocab_size: int) -> tuple[tuple[int, float], ...]:
    """{token id: bias} as a tuple of (token_id, bias) sorted by id."""
    if logit_bias is None:
        return ()
    if not isinstance(logit_bias, dict):
        raise RequestRejected(f"logit_bias must be an object of token id -> bias, got {_shown(logit_bias)}")
    if len(logit_bias) > MAX_LOGIT_BIAS_ENTRIES:
        raise RequestRejected(
            f"logit_bias has {len(logit_bias)} entries; at most {MAX_LOGIT_BIAS_ENTRIES} are allowed"
        )
    biases: dict[int, float] = {}
    for key, bias in logit_bias.items():
        token = _token_id(key, vocab_size)
        if token in biases:
            raise RequestRejected(f"logit_bias lists token id {token} twice")
        value = _real(f"logit_bias[{token}]", bias)
        if not -MAX_ABS_LOGIT_BIAS <= value <= MAX_ABS_LOGIT_BIAS:
            raise RequestRejected(f"logit_bias[{token}] must be in [-100, 100], got {value}")
        biases[token] = value
    return tuple(sorted(biases.items()))


def _token_id(key: Any, vocab_size: int) -> int:
    if isinstance(key, str) and _TOKEN_ID_TEXT.fullmatch(key):
        token = int(key)
    elif isinstance(key, int) and not isinstance(key, bool):
        token = key
    else:
        raise RequestRejected(f"logit_bias keys must be token ids (integers), got {_shown(key)}")
    if not 0 <= token < vocab_size:
        raise RequestRejected(
            f"logit_bias has unknown token id {token}: the vocabulary has ids 0..{vocab_size - 1}"
        )
    return token


def _stop(stop: Any, max_stop_strings: int, max_stop_len: int) -> tuple[str, ...]:
    """None, a string or a list of strings as a tuple without duplicates, in order."""
    if stop is None:
        return ()
    stops = [stop] if isinstance(stop, str) else stop
    if not isinstance(stops, (list, tuple)):
        raise RequestRejected(f"stop must be a string or a list of strings, got {_shown(stop)}")
    if len(stops) > max_stop_strings:
        raise RequestRejected(f"stop lists {len(stops)} strings; at most {max_stop_strings} are allowed")
    for item in stops:
        if not isinstance(item, str):
            raise RequestRejected(f"stop must be a string or a list of strings, got {_shown(item)} in the list")
        if not item:
            raise RequestRejected("stop strings must not be empty")
        if len(item) > max_stop_len:
            raise RequestRejected(
                f"stop strings must be at most {max_stop_len} characters, got one of {len(item)}"
            )
    return tuple(dict.fromkeys(stops))
