"""The GPU's prefill shape rounding: rows, keys, the front-padding mask, the graph cache size."""

from __future__ import annotations

import numpy as np

from runtime.worker.paths.prefill_shapes import (
    SDPA_CACHE_SIZE,
    SDPA_CACHE_VAR,
    continuation_length,
    front_padded_mask,
    keep_attention_graphs,
    key_length,
    padded_rows,
)


def test_continuation_lengths_are_powers_of_two():
    assert [continuation_length(n) for n in (1, 16, 17, 100, 512, 513)] == [16, 16, 32, 128, 512, 1024]


def test_rows_round_to_powers_of_two():
    assert [padded_rows(r) for r in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [1, 2, 4, 4, 8, 8, 16, 16, 32]


def test_key_lengths_recur_and_fit_the_context():
    assert key_length(37, 16, 4096) == 256
    assert key_length(1900, 256, 1 << 20) == 2560  # past 2,048: a quarter of 2,048
    assert key_length(1000, 512, 4096) == 1536
    assert key_length(3990, 100, 4096) == 4096  # rounded up to 4608 would not fit
    assert key_length(4000, 96, 4096) == 4096
    # A long prompt's later chunks attend to exactly their keys (a causal mask, no array mask).
    assert key_length(16384, 2048, 1 << 20) == 18432 and key_length(28672, 2048, 1 << 20) == 30720
    assert key_length(9000, 1024, 1 << 20) == 10024
    lengths = {key_length(s, 256, 1 << 20) for s in range(1, 4096)}
    assert len(lengths) < 16 and all(key_length(s, 256, 1 << 20) >= s + 256 for s in range(1, 4096))


def test_front_padded_mask_is_causal_after_the_padding():
    mask = np.array(front_padded_mask(start=3, length=2, keys=8, rank=4))
    assert mask.shape == (1, 1, 2, 8)
    # 3 padding keys, then positions 0..4; queries at positions 3 and 4.
    assert mask[0, 0].astype(int).tolist() == [[0, 0, 0, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 1, 1, 1]]
    assert front_padded_mask(3, 2, 8, rank=5).shape == (1, 1, 1, 2, 8)


def test_attention_graph_cache_is_raised_on_cuda_only_unless_set():
    env: dict[str, str] = {}
    assert not keep_attention_graphs(env, cuda=False) and env == {}
    assert keep_attention_graphs(env, cuda=True) and env == {SDPA_CACHE_VAR: str(SDPA_CACHE_SIZE)}
    env = {SDPA_CACHE_VAR: "10"}
    assert not keep_attention_graphs(env, cuda=True) and env == {SDPA_CACHE_VAR: "10"}
