"""The paired bench workloads (``paired``, ``first``) say how close mlx-lm itself found the two
tokens where the runtime's greedy output first differs: a near-tie is rounding, a wide gap a bug."""

from __future__ import annotations

from runtime.bench.paired import divergence, pair_outcome


class FakeMlx:
    def __init__(self, gap: float) -> None:
        self.gap = gap
        self.asked: list[tuple[list[int], int, int]] = []

    def logprob_gap(self, context: list[int], mlx_token: int, runtime_token: int) -> float:
        self.asked.append((context, mlx_token, runtime_token))
        return self.gap


def test_the_first_difference_is_found_and_scored_by_mlx_lm() -> None:
    mlx = FakeMlx(0.03)
    assert divergence([1, 2], [5, 6, 7], [5, 6, 8, 9], mlx) == {"position": 2, "logprob_gap": 0.03}
    assert mlx.asked == [([1, 2, 5, 6], 8, 7)]  # the prompt and mlx-lm's tokens before the difference
    assert divergence([1], [5, 6], [5, 6, 7], FakeMlx(1.0)) is None  # one side stopped first: no difference


def test_the_warning_says_whether_each_difference_is_a_near_tie() -> None:
    data: dict = {}
    tie = pair_outcome("first", "t", [], data, [False, True], [{"position": 3, "logprob_gap": 0.02}, None])
    assert len(tie.warnings) == 1
    assert "1 of 2 pairs" in tie.warnings[0] and "position 3" in tie.warnings[0] and "(a near-tie)" in tie.warnings[0]
    wide = pair_outcome("paired", "t", [], data, [False], [{"position": 0, "logprob_gap": 2.5}])
    assert "NOT a near-tie" in wide.warnings[0]
    assert pair_outcome("paired", "t", [], data, [True], [None]).warnings == []
