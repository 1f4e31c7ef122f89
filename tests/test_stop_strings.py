"""StopMatcher: stop strings across delta boundaries, hold-back of possible prefixes."""

from __future__ import annotations

import random

import pytest

from runtime.scheduler.stop_strings import StopMatcher


def run(stops: list[str], deltas: list[str]) -> tuple[list[str], str | None, str]:
    """Feed every delta; return (emitted pieces, matched stop, flushed tail)."""
    matcher = StopMatcher(stops)
    pieces: list[str] = []
    matched = None
    for delta in deltas:
        piece, matched = matcher.feed(delta)
        pieces.append(piece)
    return pieces, matched, matcher.flush()


def test_stop_split_across_single_character_deltas():
    pieces, matched, tail = run(["STOP"], list("hello STOP world"))
    assert "".join(pieces) == "hello "
    assert matched == "STOP"
    assert tail == ""
    # "S", "T", "O" were held back: nothing was emitted while the stop was forming.
    assert pieces[6:10] == ["", "", "", ""]


def test_partial_prefix_overlaps_the_stop():
    matcher = StopMatcher(["ab"])
    assert matcher.feed("a") == ("", None)
    assert matcher.held == "a"
    # "aa": the first "a" can no longer start "ab"; the second still can.
    assert matcher.feed("a") == ("a", None)
    assert matcher.held == "a"
    assert matcher.feed("b") == ("", "ab")


def test_aab_in_one_delta():
    assert StopMatcher(["ab"]).feed("aab") == ("a", "ab")


def test_later_listed_stop_that_starts_earlier_wins():
    matcher = StopMatcher(["world", "lo w"])
    assert matcher.feed("hello world") == ("hel", "lo w")


def test_same_start_prefers_the_shorter_stop():
    assert StopMatcher(["abc", "ab"]).feed("xabcd") == ("x", "ab")
    pieces, matched, _ = run(["abc", "ab"], list("xabcd"))
    assert ("".join(pieces), matched) == ("x", "ab")


def test_nested_stop_depends_on_delta_split():
    # "b" lies inside "abc": in one buffer the earlier-starting "abc" wins ...
    assert StopMatcher(["b", "abc"]).feed("xabc") == ("x", "abc")
    # ... but streamed, "b" completes first and is reported at once.
    matcher = StopMatcher(["b", "abc"])
    assert matcher.feed("xa") == ("x", None)
    assert matcher.feed("b") == ("a", "b")
    assert matcher.feed("c") == ("", "b")


def test_held_prefix_that_is_not_a_stop_is_emitted_on_next_feed():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("x </e") == ("x ", None)
    assert matcher.held == "</e"
    assert matcher.feed("xtra") == ("</extra", None)
    assert matcher.held == ""
    assert matcher.flush() == ""


def test_held_prefix_is_returned_by_flush():
    matcher = StopMatcher(["</end>"])
    assert matcher.feed("done </en") == ("done ", None)
    assert matcher.flush() == "</en"
    assert matcher.held == ""


def test_stop_at_the_very_start():
    matcher = StopMatcher(["\n\n"])
    assert matcher.feed("\n\nrest") == ("", "\n\n")
    assert matcher.matched == "\n\n"


def test_feeds_after_a_match_return_nothing():
    matcher = StopMatcher(["x"])
    assert matcher.feed("axb") == ("a", "x")
    assert matcher.feed("more") == ("", "x")
    assert matcher.flush() == ""


def test_unicode_stops_and_text():
    pieces, matched, tail = run(["終わり", "🛑"], ["こんにちは、", "終", "わ", "り", "です"])
    assert ("".join(pieces), matched, tail) == ("こんにちは、", "終わり", "")
    matcher = StopMatcher(["🛑!"])
    assert matcher.feed("ok🛑") == ("ok", None)
    assert matcher.feed("?") == ("🛑?", None)
    assert matcher.feed("é🛑!") == ("é", "🛑!")


def test_no_stop_emits_everything():
    pieces, matched, tail = run(["zzz"], ["abc", "z", "zy", "zz"])
    assert matched is None
    assert pieces == ["abc", "", "zzy", ""]
    assert tail == "zz"


def test_held_back_text_is_shorter_than_the_longest_stop():
    matcher = StopMatcher(["a" * 8 + "b", "c"])
    assert matcher.max_len == 9
    for i in range(50):
        assert matcher.feed("a") == ("" if i < 8 else "a", None)
        assert matcher.held == "a" * min(i + 1, 8)
    assert matcher.feed("b") == ("", "a" * 8 + "b")


@pytest.mark.parametrize("stops", [[], [""], ["ok", ""], [None]])
def test_bad_stop_lists_are_refused(stops):
    with pytest.raises(ValueError, match="stops"):
        StopMatcher(stops)


def _random_split(rng: random.Random, text: str) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), rng.randint(0, min(len(text) - 1, 6))))
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


# No stop in a set is a substring of another: then the answer cannot depend on the split.
@pytest.mark.parametrize("stops", [["ab"], ["aab", "ba"], ["abc", "ca", "bb"], ["aaa"]])
def test_any_split_gives_the_whole_text_answer(stops):
    rng = random.Random(7)
    for _ in range(400):
        text = "".join(rng.choice("abc") for _ in range(rng.randint(1, 14)))
        hits = [(text.find(s), s) for s in stops if s in text]
        want_text, want_stop = (text[: min(hits)[0]], min(hits)[1]) if hits else (text, None)
        matcher = StopMatcher(stops)
        emitted, fed, matched = "", "", None
        for delta in _random_split(rng, text):
            fed += delta
            piece, matched = matcher.feed(delta)
            emitted += piece
            if matched is None:
                assert emitted + matcher.held == fed
                assert len(matcher.held) < matcher.max_len
        if matched is None:
            emitted += matcher.flush()
        assert (emitted, matched) == (want_text, want_stop), (text, stops)
