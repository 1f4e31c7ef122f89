"""The array functions of one batched sampling step (see ``sampler.RowSampler``): penalties,
log-softmax, top-k / top-p / min-p, seeded Gumbel-max draws and the logprobs outputs.

Pure functions of MLX arrays, compiled by the sampler once per combination of features.
Indices are int32 and gathered values float32 throughout: MLX's CUDA gather kernels are
built per (value dtype, index dtype) at first use, so fewer combinations build faster.
"""

from __future__ import annotations

import mlx.core as mx


def or_default(value: mx.array | None, default: mx.array) -> mx.array:
    return value if value is not None else default


def sample_step(
    penalties: tuple[bool, bool, bool], draw_key: tuple | None, top_n: int | None,
    logits: mx.array, x: mx.array, counts: mx.array, rows: mx.array, repetition: mx.array, presence: mx.array,
    frequency: mx.array, positions: mx.array, inv_temp: mx.array, seeds: mx.array, top_k: mx.array,
    top_p: mx.array, log_min_p: mx.array, sampled: mx.array,
) -> tuple[mx.array, ...]:
    """One batch's tokens (and, for ``top_n`` not None, the logprobs outputs of ``chosen_and_top``
    from the raw ``logits``). ``x``: the logits after bias and masks; the penalties
    (repetition, presence, frequency as flagged) count each row's generated tokens in
    ``counts[rows]``; then the log-softmax, greedy, and where ``sampled``, ``draw``'s token."""
    if any(penalties):
        counts = counts[rows]
        seen = counts > 0
        if penalties[0]:
            rep = repetition[:, None].astype(x.dtype)
            x = mx.where(seen, mx.where(x < 0, x * rep, x / rep), x)
        if penalties[1]:
            x = x - (presence[:, None] * seen).astype(x.dtype)
        if penalties[2]:
            x = x - (frequency[:, None] * counts).astype(x.dtype)
    logprobs = x - mx.logsumexp(x, axis=-1, keepdims=True)
    tokens = mx.argmax(logprobs, axis=-1).astype(mx.int32)
    if draw_key is not None:
        drawn = draw(*draw_key, logprobs, positions, inv_temp, seeds, top_k, top_p, log_min_p)
        tokens = mx.where(sampled, drawn, tokens)
    if top_n is None:
        return (tokens,)
    return (tokens, *chosen_and_top(top_n, logits, tokens))


def draw(
    mode: str, k_max: int, has_top_k: bool, has_top_p: bool, has_min_p: bool,
    logprobs: mx.array, positions: mx.array, inv_temp: mx.array, seeds: mx.array,
    top_k: mx.array, top_p: mx.array, log_min_p: mx.array,
) -> mx.array:
    """Top-k, top-p and min-p as mlx-lm keeps them, then Gumbel-max at each row's temperature.

    Works on the candidates in descending order: the top ``k_max`` of each row (one
    partition, no full sort) in mode "top" (every sampled row has a top-k), the whole
    vocabulary sorted in mode "sorted" (a row has top-p, or top-k beside a row without one),
    unsorted in mode "all". The noise is keyed by token id, so the choice does not depend on
    which mode a batch takes.
    """
    vocab = logprobs.shape[-1]
    if mode == "top":
        cand, values = top_candidates(logprobs.astype(mx.float32), k_max)
    elif mode == "sorted":
        cand = mx.argsort(-logprobs, axis=-1).astype(mx.int32)
        values = mx.take_along_axis(logprobs.astype(mx.float32), cand, axis=-1)
    else:
        cand, values = None, logprobs
    ranked = cand is not None
    keep = None
    if ranked and has_top_k:
        keep = mx.arange(values.shape[-1], dtype=mx.int32)[None, :] < top_k[:, None]
    if ranked and has_top_p:
        probs = mx.exp(values.astype(mx.float32))
        above = mx.cumsum(probs, axis=-1) - probs  # the mass of the better candidates
        nucleus = above < top_p[:, None]
        keep = nucleus if keep is None else keep & nucleus
    if has_min_p:
        own = values.astype(logprobs.dtype)  # compared in the logprobs' own dtype, as mlx-lm does
        best = own[:, :1] if ranked else mx.max(own, axis=-1, keepdims=True)
        high = own >= best + log_min_p[:, None].astype(own.dtype)
        keep = high if keep is None else keep & high
    ids = cand if cand is not None else mx.broadcast_to(mx.arange(vocab, dtype=mx.int32)[None, :], values.shape)
    scores = values.astype(mx.float32) * inv_temp[:, None] + gumbel(seeds, positions, ids)
    if keep is not None:
        scores = mx.where(keep, scores, mx.array(-float("inf"), dtype=mx.float32))
    choice = mx.argmax(scores, axis=-1).astype(mx.int32)
    if cand is None:
        return choice
    return mx.take_along_axis(cand, choice[:, None], axis=-1)[:, 0]


CHUNK = 128


def top_candidates(x: mx.array, k: int) -> tuple[mx.array, mx.array]:
    """The ``k`` largest entries of each row of ``x`` [rows, n] as (int32 ids, values), best first.

    Exact, without partitioning the whole row: every one of the k largest lies in one of the
    k chunks (of CHUNK entries) with the largest maxima, since fewer than k entries rank
    above it and each better chunk's maximum is one of them. So the rows' chunk maxima are
    partitioned, and then only those k chunks.
    """
    rows, n = x.shape
    chunks = -(-n // CHUNK)
    if chunks <= k or n <= 4 * CHUNK:
        ids = mx.argpartition(-x, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
    else:
        padded = x if chunks * CHUNK == n else mx.pad(x, [(0, 0), (0, chunks * CHUNK - n)], constant_values=-float("inf"))
        blocks = padded.reshape(rows, chunks, CHUNK)
        best_blocks = mx.argpartition(-blocks.max(axis=-1), kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        inside = mx.take_along_axis(blocks, best_blocks[:, :, None], axis=1).reshape(rows, k * CHUNK)
        block_ids = (best_blocks[:, :, None] * CHUNK + mx.arange(CHUNK, dtype=mx.int32)).reshape(rows, k * CHUNK)
        pick = mx.argpartition(-inside, kth=k - 1, axis=-1)[:, :k].astype(mx.int32)
        ids = mx.take_along_axis(block_ids, pick, axis=-1)
    values = mx.take_along_axis(x, ids, axis=-1)
    order = mx.argsort(-values, axis=-1).astype(mx.int32)
    return mx.take_along_axis(ids, order, axis=-1), mx.take_along_axis(values, order, axis=-1)


def chosen_and_top(top_n: int, logits: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The chosen tokens' log-probabilities and the ``top_n`` best (ids, values), from the
    model's own log-softmax in float32, before any bias, penalty or filter."""
    raw = logits.astype(mx.float32)
    raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    if not top_n:
        return chosen, chosen, chosen
    best, values = top_candidates(raw, top_n)
    return chosen, best, values


def mix(x: mx.array) -> mx.array:
    """A 32-bit integer hash round (xor-shift-multiply), applied elementwise."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def gumbel(seeds: mx.array, positions: mx.array, token_ids: mx.array) -> mx.array:
    """Gumbel noise for each (row, candidate token) from (row seed, position, token id) alone:
    a row's draws do not depend on the batch or on which candidates are scored."""
    token = token_ids.astype(mx.uint32)
    x = mix(seeds[:, :1] ^ mix(positions[:, None] * 0x9E3779B9 + 0x632BE5AB))
    x = mix(x ^ (token * 0x85EBCA6B) ^ seeds[:, 1:2])
    x = mix(x + 0x27D4EB2F)
    uniform = ((x >> 8).astype(mx.float32) + 0.5) * (1.0 / 16777216.0)
    return -mx.log(-mx.log(uniform))
