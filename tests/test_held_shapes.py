"""Which CUDA decode steps take a compiled trace (``HeldShapes``): pure bookkeeping, testable anywhere."""

from __future__ import annotations

from runtime.worker.paths.cuda.compiled_paged import HeldShapes


def test_few_rows_always_compiled() -> None:
    held = HeldShapes(always_rows=8, after=4)
    assert all(held.compiled((rows, 0, (1, 4)), set()) for rows in (1, 2, 4, 8))
    assert held.seen == {}


def test_many_rows_compiled_once_the_key_recurs() -> None:
    held = HeldShapes(always_rows=8, after=3)
    key = (64, 5, (1, 8))
    assert [held.compiled(key, set()) for _ in range(4)] == [False, False, True, True]
    other = (64, 6, (1, 8))  # another tail length is its own key
    assert not held.compiled(other, set())


def test_a_traced_key_stays_compiled() -> None:
    held = HeldShapes(always_rows=8, after=100)
    key = (32, 0, (2, 8))
    assert held.compiled(key, {key})


def test_counts_stay_bounded() -> None:
    held = HeldShapes(always_rows=1, after=2)
    for n in range(HeldShapes.MAX_KEYS + 10):
        held.compiled((16, n, (1, 1)), set())
    assert len(held.seen) <= HeldShapes.MAX_KEYS
