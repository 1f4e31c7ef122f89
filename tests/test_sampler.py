"""The worker's per-row sampler against mlx-lm's own samplers: allowed sets, distributions, invariance."""

from __future__ import annotations

import math

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm.sample_utils import apply_min_p, apply_top_k, apply_top_p, make_sampler

from runtime.protocol.worker import DecodeBatch, RowSampling
from runtime.worker.sampler import RowSampler

VOCAB = 48
DRAWS = 6000


def _logits(seed: int = 0) -> mx.array:
    rng = np.random.default_rng(seed)
    return mx.array(rng.normal(0.0, 2.0, VOCAB).astype(np.float32))


def _batch(n: int, positions: list[int] | None = None) -> DecodeBatch:
    return DecodeBatch(rows=list(range(n)), token_ids=[-1] * n, positions=positions or list(range(n)),
                       slot_ids=[0] * n, temperatures=[0.0] * n)


def _draw(spec: dict, logits: mx.array, n: int = DRAWS) -> np.ndarray:
    sampler = RowSampler(max_rows=n)
    sampler.configure([RowSampling(row=r, **spec) for r in range(n)])
    batch = mx.broadcast_to(logits[None], (n, VOCAB))
    return np.array(sampler.sample(batch, _batch(n)).tokens)


def _histogram(tokens: np.ndarray) -> np.ndarray:
    return np.bincount(tokens, minlength=VOCAB) / len(tokens)


FILTERS = [
    dict(temperature=1.0),
    dict(temperature=0.7, top_k=5),
    dict(temperature=1.2, top_p=0.8),
    dict(temperature=0.9, min_p=0.08),
    dict(temperature=0.8, top_k=10, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("spec", FILTERS)
def test_draws_follow_mlx_lm_samplers(spec):
    logits = _logits()
    logprobs = logits - mx.logsumexp(logits)
    kept = logprobs[None]
    if spec.get("top_p", 1.0) < 1.0:
        kept = apply_top_p(kept, spec["top_p"])
    if spec.get("min_p", 0.0):
        kept = apply_min_p(kept, spec["min_p"])
    if spec.get("top_k", 0):
        kept = apply_top_k(kept, spec["top_k"])
    allowed = set(np.nonzero(np.isfinite(np.array(kept[0])))[0].tolist())
    exact = np.array(mx.softmax(kept[0] / spec["temperature"]))

    ours = _draw(dict(spec, seed=11), logits)
    mx.random.seed(3)
    theirs_sampler = make_sampler(temp=spec["temperature"], top_p=spec.get("top_p", 0.0),
                                  min_p=spec.get("min_p", 0.0), top_k=spec.get("top_k", 0))
    theirs = np.array(theirs_sampler(mx.broadcast_to(logprobs[None], (DRAWS, VOCAB))))

    assert set(ours.tolist()) <= allowed and set(theirs.tolist()) <= allowed
    tv_ours = 0.5 * np.abs(_histogram(ours) - exact).sum()
    tv_theirs = 0.5 * np.abs(_histogram(theirs) - exact).sum()
    tv_between = 0.5 * np.abs(_histogram(ours) - _histogram(theirs)).sum()
    assert tv_ours < 0.05 and tv_theirs < 0.05 and tv_between < 0.07, (tv_ours, tv_theirs, tv_between)


def test_a_row_draws_the_same_token_alone_or_in_any_batch():
    logits = [_logits(s) for s in range(6)]
    specs = [
        dict(temperature=0.9, seed=5),
        dict(temperature=1.3, top_k=4, seed=6),
        dict(),
        dict(temperature=0.6, top_p=0.7, seed=7, logprobs=True, top_logprobs=3),
        dict(temperature=1.0, min_p=0.2, seed=8, logit_bias=[(3, 2.0)]),
        dict(temperature=1.0, seed=5),
    ]
    positions = [10, 11, 12, 13, 14, 10]

    def run(order: list[int]) -> dict[int, int]:
        sampler = RowSampler(max_rows=8)
        sampler.configure([RowSampling(row=r, **specs[i]) for r, i in enumerate(order)])
        batch = mx.stack([logits[i] for i in order])
        got = sampler.sample(batch, _batch(len(order), [positions[i] for i in order])).tokens.tolist()
        return {i: got[r] for r, i in enumerate(order)}

    together = run([0, 1, 2, 3, 4, 5])
    shuffled = run([4, 2, 5, 0, 3, 1])
    for i in range(6):
        assert run([i])[i] == together[i] == shuffled[i]
    assert together[2] == int(mx.argmax(logits[2]))


def test_greedy_rows_with_filters_or_top_k_one_take_the_argmax():
    logits = _logits(4)
    for spec in (dict(temperature=2.0, top_k=1, seed=1), dict(top_p=0.5), dict(min_p=0.5)):
        tokens = _draw(dict(spec), logits, n=50)
        assert set(tokens.tolist()) == {int(mx.argmax(logits))}


def test_penalty_counts_follow_the_lazy_tokens_of_chained_steps():
    sampler = RowSampler(max_rows=2)
    sampler.configure([RowSampling(row=0, frequency_penalty=1.5), RowSampling(row=1)])
    logits = mx.zeros((2, VOCAB))
    logits[:, 7] = 1.0  # row 0 takes 7, then 7 is penalized below the rest
    first = sampler.sample(logits, _batch(2)).tokens
    second = sampler.sample(logits, _batch(2)).tokens  # built before the first is read back
    assert first.tolist() == [7, 7] and second.tolist()[1] == 7 and second.tolist()[0] != 7
    assert sampler.counts is not None and sampler.counts[0, 7].item() == 1.0
    sampler.configure([RowSampling(row=0, frequency_penalty=1.5)])  # a new request in row 0
    assert sampler.sample(logits, _batch(2)).tokens.tolist()[0] == 7


def test_logprobs_are_the_unfiltered_log_softmax():
    logits = _logits(9)
    sampler = RowSampler(max_rows=1)
    sampler.configure([RowSampling(row=0, temperature=0.5, top_k=2, seed=1, logprobs=True, top_logprobs=4,
                                   logit_bias=[(0, 3.0)])])
    draws = sampler.sample(logits[None], _batch(1))
    raw = np.array(logits - mx.logsumexp(logits))
    token = draws.tokens.item()
    assert draws.token_logprobs.item() == pytest.approx(raw[token], abs=1e-6)
    assert draws.top_ids[0].tolist() == np.argsort(-raw)[:4].tolist()
    assert math.isclose(np.exp(raw).sum(), 1.0, rel_tol=1e-5)


def test_top_k_holds_beside_a_sampled_row_without_one():
    logits = _logits(2)
    sampler = RowSampler(max_rows=64)
    specs = [RowSampling(row=r, temperature=1.5, top_k=1, seed=r) for r in range(32)]
    specs += [RowSampling(row=32 + r, temperature=1.5, seed=r) for r in range(32)]  # no top-k: the full sort
    sampler.configure(specs)
    tokens = sampler.sample(mx.broadcast_to(logits[None], (64, VOCAB)), _batch(64)).tokens.tolist()
    assert set(tokens[:32]) == {int(mx.argmax(logits))} and len(set(tokens[32:])) > 1


@pytest.mark.parametrize("n, k", [(1000, 5), (128256, 50), (5000, 20), (300, 7), (1030, 64)])
def test_top_candidates_equal_a_full_sort(n, k):
    from runtime.worker.sampling_ops import top_candidates

    rng = np.random.default_rng(n + k)
    x = mx.array(rng.normal(0, 3, (3, n)).astype(np.float32))
    ids, values = top_candidates(x, k)
    expected = np.argsort(-np.array(x), axis=-1)[:, :k]
    assert ids.tolist() == expected.tolist()
    assert np.allclose(np.array(values), np.take_along_axis(np.array(x), expected, axis=-1))


def test_padding_rows_change_nothing_for_the_batch_rows():
    """A batch padded to its row bucket (extra logits rows at the end) draws the same tokens,
    logprobs and penalty counts for its rows as the exact batch."""
    specs = [
        dict(temperature=0.9, top_k=5, seed=1, frequency_penalty=0.5, logprobs=True, top_logprobs=2),
        dict(),
        dict(temperature=0.7, top_p=0.8, seed=2, presence_penalty=0.3),
    ]
    rows = [_logits(10 + i) for i in range(3)]
    padding = [_logits(99)] * 5

    def run(extra: list[mx.array]):
        sampler = RowSampler(max_rows=8)
        sampler.configure([RowSampling(row=r, **spec) for r, spec in enumerate(specs)])
        out = []
        for step in range(3):
            draws = sampler.sample(mx.stack(rows + extra), _batch(3, [20 + step] * 3))
            out.append((draws.tokens.tolist(), draws.token_logprobs.tolist(), draws.top_ids.tolist()))
        return out, sampler.counts[:3].tolist()

    exact, padded = run([]), run(padding)
    assert padded == exact
    assert len(padded[0][0][0]) == 3  # padding rows are dropped from every output


def test_warm_up_leaves_no_row_behind() -> None:
    """The start-up warm-up runs every feature on row 0 and then forgets it: a sampler that
    warmed up draws exactly what a fresh one draws, penalties and logprobs included."""
    spec = RowSampling(row=0, temperature=0.7, top_k=8, frequency_penalty=0.8, seed=5, logprobs=True, top_logprobs=3)
    logits = mx.broadcast_to(_logits(3)[None], (2, VOCAB))

    def run(sampler: RowSampler) -> list:
        sampler.configure([spec])
        out = []
        for step in range(4):
            batch = DecodeBatch(rows=[0, 1], token_ids=[-1, -1], positions=[step, step], slot_ids=[0, 0],
                                temperatures=[0.0, 0.0])
            draws = sampler.sample(logits, batch)
            out.append((draws.tokens.tolist(), draws.top_ids.tolist(), draws.token_logprobs.tolist()))
        return out

    warmed = RowSampler(max_rows=2)
    warmed.warm_up(VOCAB, mx.float32)
    assert not warmed.specs and warmed.counts is None and warmed._draws  # compiled functions kept
    assert run(warmed) == run(RowSampler(max_rows=2))


def test_a_batch_of_plain_greedy_rows_skips_the_sampling_step(monkeypatch):
    import runtime.worker.sampler as sampler_module

    calls = []
    real = sampler_module.sample_step

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr(sampler_module, "sample_step", counting)
    sampler = RowSampler(max_rows=4, compiled=False)
    sampler.configure([RowSampling(row=3, temperature=0.8, top_p=0.9, seed=1)])  # a sampled row, not in the batch
    logits = mx.array(np.random.default_rng(0).normal(size=(2, 50)).astype(np.float32))
    greedy = DecodeBatch(rows=[0, 1], token_ids=[1, 1], positions=[2, 2], slot_ids=[0, 0], temperatures=[0.0, 0.0])
    assert sampler.sample(logits, greedy).tokens.tolist() == np.argmax(np.array(logits), axis=-1).tolist()
    assert calls == []  # the fast path: an argmax, no sampling step
    mixed = DecodeBatch(rows=[0, 3], token_ids=[1, 1], positions=[2, 2], slot_ids=[0, 0], temperatures=[0.0, 0.8])
    mx.eval(sampler.sample(logits, mixed).tokens)
    assert calls == [1]
