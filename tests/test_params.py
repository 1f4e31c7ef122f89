"""check_sampling: valid edges accepted, each invalid value refused naming its parameter."""

from __future__ import annotations

import math
from typing import Any

import pytest

from runtime.scheduler.admission import RequestRejected
from runtime.scheduler.params import SamplingChoice, check_sampling

VOCAB = 256

OFF: dict[str, Any] = {
    "temperature": 0.0,
    "top_p": 1.0,
    "top_k": 0,
    "min_p": 0.0,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "logit_bias": None,
    "seed": None,
    "min_tokens": 0,
    "stop": None,
    "logprobs": False,
    "top_logprobs": 0,
}


def check(**changes: Any) -> SamplingChoice:
    return check_sampling(**{**OFF, **changes}, vocab_size=VOCAB)


def test_all_off_is_the_default_choice():
    assert check() == SamplingChoice()


def test_every_value_is_stored():
    choice = check(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        logit_bias={"7": 1.5, 3: -2},
        seed=42,
        min_tokens=5,
        stop=["\n", "END"],
        logprobs=True,
        top_logprobs=3,
    )
    assert choice == SamplingChoice(
        temperature=0.7,
        top_p=0.9,
        top_k=40,
        min_p=0.05,
        repetition_penalty=1.1,
        presence_penalty=-0.5,
        frequency_penalty=0.25,
        logit_bias=((3, -2.0), (7, 1.5)),
        seed=42,
        min_tokens=5,
        stop=("\n", "END"),
        logprobs=True,
        top_logprobs=3,
    )
    assert isinstance(choice.logit_bias[0][1], float)
    with pytest.raises(AttributeError):
        choice.top_k = 1  # type: ignore[misc]


@pytest.mark.parametrize(
    ("name", "value", "stored"),
    [
        ("temperature", 1e-6, 0.0),
        ("temperature", 1e-5, 1e-5),
        ("temperature", 10000, 10000.0),
        ("top_p", 1e-9, 1e-9),
        ("top_p", 1, 1.0),
        ("top_k", 1, 1),
        ("top_k", 10**6, 10**6),
        ("min_p", 1.0, 1.0),
        ("min_p", 0, 0.0),
        ("repetition_penalty", 1e-3, 1e-3),
        ("repetition_penalty", 10, 10.0),
        ("presence_penalty", -2, -2.0),
        ("presence_penalty", 2.0, 2.0),
        ("frequency_penalty", -2.0, -2.0),
        ("frequency_penalty", 2, 2.0),
        ("seed", 0, 0),
        ("seed", 2**64 - 1, 2**64 - 1),
        ("min_tokens", 0, 0),
        ("min_tokens", 100, 100),
        ("logit_bias", {}, ()),
        ("logit_bias", {0: -100, "255": 100.0}, ((0, -100.0), (255, 100.0))),
        ("logit_bias", {i: 0.0 for i in range(256)} | {}, tuple((i, 0.0) for i in range(256))),
        ("stop", "x", ("x",)),
        ("stop", [], ()),
        ("stop", ["a", "b", "a"], ("a", "b")),
        ("stop", ["s" * 256] * 16, ("s" * 256,)),
        ("logprobs", True, True),
        ("logprobs", None, False),
        ("top_logprobs", None, 0),
    ],
)
def test_valid_edges_are_accepted(name, value, stored):
    assert getattr(check(**{name: value}), name) == stored


def test_top_logprobs_edge_with_logprobs():
    assert check(logprobs=True, top_logprobs=20).top_logprobs == 20
    assert check(logprobs=True, top_logprobs=0).top_logprobs == 0


def test_logit_bias_entry_limit_is_1024():
    many = {i: 1.0 for i in range(1024)}
    assert len(check_sampling(**{**OFF, "logit_bias": many}, vocab_size=4096).logit_bias) == 1024
    with pytest.raises(RequestRejected, match="logit_bias has 1025 entries; at most 1024"):
        check_sampling(**{**OFF, "logit_bias": {i: 1.0 for i in range(1025)}}, vocab_size=4096)


NAN = math.nan
INF = math.inf


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        ("temperature", NAN, "temperature must be a finite number"),
        ("temperature", INF, "temperature must be a finite number"),
        ("temperature", -0.1, "temperature must be >= 0"),
        ("temperature", 10001, "temperature must be at most 10000"),
        ("temperature", "1", "temperature must be a number"),
        ("temperature", True, "temperature must be a number"),
        ("temperature", None, "temperature must be a number"),
        ("top_p", 0, r"top_p must be in \(0, 1\]"),
        ("top_p", 1.0000001, r"top_p must be in \(0, 1\]"),
        ("top_p", -0.5, r"top_p must be in \(0, 1\]"),
        ("top_p", NAN, "top_p must be a finite number"),
        ("top_p", True, "top_p must be a number"),
        ("top_k", -1, "top_k must be 0 .off. or at least 1"),
        ("top_k", 1.0, "top_k must be an integer"),
        ("top_k", True, "top_k must be an integer"),
        ("top_k", "5", "top_k must be an integer"),
        ("min_p", -0.01, r"min_p must be in \[0, 1\]"),
        ("min_p", 1.5, r"min_p must be in \[0, 1\]"),
        ("min_p", INF, "min_p must be a finite number"),
        ("repetition_penalty", 0, r"repetition_penalty must be in \(0, 10\]"),
        ("repetition_penalty", -1.0, r"repetition_penalty must be in \(0, 10\]"),
        ("repetition_penalty", 10.5, r"repetition_penalty must be in \(0, 10\]"),
        ("repetition_penalty", NAN, "repetition_penalty must be a finite number"),
        ("presence_penalty", -2.01, r"presence_penalty must be in \[-2, 2\]"),
        ("presence_penalty", 3, r"presence_penalty must be in \[-2, 2\]"),
        ("presence_penalty", -INF, "presence_penalty must be a finite number"),
        ("frequency_penalty", 2.5, r"frequency_penalty must be in \[-2, 2\]"),
        ("frequency_penalty", NAN, "frequency_penalty must be a finite number"),
        ("frequency_penalty", 10**400, "frequency_penalty must be a finite number"),
        ("logit_bias", [1, 2], "logit_bias must be an object"),
        ("logit_bias", {256: 1.0}, "logit_bias has unknown token id 256: the vocabulary has ids 0..255"),
        ("logit_bias", {-1: 1.0}, "logit_bias has unknown token id -1"),
        ("logit_bias", {"-1": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {"1.5": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {" 12": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {"abc": 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {True: 1.0}, "logit_bias keys must be token ids"),
        ("logit_bias", {5: 1.0, "5": 2.0}, "logit_bias lists token id 5 twice"),
        ("logit_bias", {5: 100.5}, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ("logit_bias", {5: -101}, r"logit_bias\[5\] must be in \[-100, 100\]"),
        ("logit_bias", {5: NAN}, r"logit_bias\[5\] must be a finite number"),
        ("logit_bias", {5: INF}, r"logit_bias\[5\] must be a finite number"),
        ("logit_bias", {5: "1"}, r"logit_bias\[5\] must be a number"),
        ("seed", -1, r"seed must be in 0..2\*\*64-1"),
        ("seed", 2**64, r"seed must be in 0..2\*\*64-1"),
        ("seed", 1.0, "seed must be an integer"),
        ("seed", False, "seed must be an integer"),
        ("min_tokens", -1, "min_tokens must be >= 0"),
        ("min_tokens", 2.0, "min_tokens must be an integer"),
        ("min_tokens", True, "min_tokens must be an integer"),
        ("stop", 5, "stop must be a string or a list of strings"),
        ("stop", {"a": 1}, "stop must be a string or a list of strings"),
        ("stop", ["a", 1], "stop must be a string or a list of strings, got 1 in the list"),
        ("stop", "", "stop strings must not be empty"),
        ("stop", ["a", ""], "stop strings must not be empty"),
        ("stop", ["s" * 257], "stop strings must be at most 256 characters, got one of 257"),
        ("stop", ["s"] * 17, "stop lists 17 strings; at most 16 are allowed"),
        ("logprobs", 1, "logprobs must be true or false"),
        ("logprobs", "true", "logprobs must be true or false"),
        ("top_logprobs", -1, "top_logprobs must be in 0..20"),
        ("top_logprobs", 21, "top_logprobs must be in 0..20"),
        ("top_logprobs", 2.0, "top_logprobs must be an integer"),
        ("top_logprobs", True, "top_logprobs must be an integer"),
        ("top_logprobs", 1, r"top_logprobs \(1\) requires logprobs to be true"),
    ],
)
def test_invalid_values_are_refused_naming_the_parameter(name, value, message):
    with pytest.raises(RequestRejected, match=message):
        check(**{name: value})


def test_top_logprobs_over_20_is_refused_even_with_logprobs():
    with pytest.raises(RequestRejected, match="top_logprobs must be in 0..20, got 21"):
        check(logprobs=True, top_logprobs=21)


def test_stop_limits_are_configurable():
    with pytest.raises(RequestRejected, match="at most 2 are allowed"):
        check_sampling(**{**OFF, "stop": ["a", "b", "c"]}, vocab_size=VOCAB, max_stop_strings=2)
    with pytest.raises(RequestRejected, match="at most 3 characters"):
        check_sampling(**{**OFF, "stop": "abcd"}, vocab_size=VOCAB, max_stop_len=3)


def test_request_rejected_is_a_value_error():
    with pytest.raises(ValueError):
        check(top_p=0)


def test_a_temperature_below_the_minimum_is_greedy():
    assert check(temperature=1e-6).temperature == 0.0


def test_prompt_logprobs_is_off_or_a_top_count():
    from runtime.scheduler.params import check_prompt_logprobs

    assert check_prompt_logprobs(None) == -1 and check_prompt_logprobs(0) == 0 and check_prompt_logprobs(20) == 20
    for bad in (-1, 21, True, 1.5, "3"):
        with pytest.raises(RequestRejected, match="prompt_logprobs"):
            check_prompt_logprobs(bad)
