"""Per-row token choice inside one batched decode step: penalties, bias, filters, seeded draws, logprobs.

Every row has its own parameters (``RowSampling``, sent once when a request takes the row);
rows with different parameters share the step. The order follows mlx-lm's
``make_logits_processors`` and ``make_sampler``: logit bias and penalties change the logits,
then the log-softmax, then top-p, min-p and top-k (each computed on that distribution, so the
kept set is their intersection, as in mlx-lm), then temperature. Draws are Gumbel-max with
noise hashed from (seed, position, token id): a row's tokens do not depend on the other rows
or on any global random state. Penalty counts of generated tokens stay on the device and are
updated from the lazy tokens, so chained decode never waits for a read-back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import partial

import mlx.core as mx
import numpy as np

from runtime.protocol.worker import DecodeBatch, RowSampling

_PLAIN = RowSampling(row=-1)


def is_plain(spec: RowSampling) -> bool:
    """Plain greedy: argmax of the model's log-probabilities, nothing else."""
    return (
        spec.temperature == 0.0 and spec.repetition_penalty == 1.0 and spec.presence_penalty == 0.0
        and spec.frequency_penalty == 0.0 and not spec.logit_bias and not spec.logprobs and not spec.stop_ids
    )


@dataclass
class StepDraws:
    """A decode step's lazy outputs: tokens, and logprobs when a row asked."""

    tokens: mx.array
    token_logprobs: mx.array | None = None
    top_ids: mx.array | None = None
    top_logprobs: mx.array | None = None

    def arrays(self) -> list[mx.array]:
        return [a for a in (self.tokens, self.token_logprobs, self.top_ids, self.top_logprobs) if a is not None]


@dataclass(frozen=True)
class _BatchParams:
    """Per-row parameter arrays of one batch composition (cached while the rows stay the same)."""

    specs: tuple[RowSampling, ...]
    rows: mx.array
    inv_temp: mx.array
    sampled: mx.array
    any_sampled: bool
    top_k: mx.array | None
    k_max: int
    top_p: mx.array | None
    log_min_p: mx.array | None
    seeds: mx.array
    bias: tuple[list[int], list[int], list[float]] | None
    repetition: mx.array | None
    presence: mx.array | None
    frequency: mx.array | None
    penalties: bool
    top_n: int
    logprobs: bool


class RowSampler:
    """Sampling parameters per request row and the device-side counts of generated tokens."""

    def __init__(self, max_rows: int, compiled: bool = True) -> None:
        self.max_rows = max_rows
        self.compiled = compiled  # draws and logprobs as mx.compile'd functions
        self.specs: dict[int, RowSampling] = {}
        self.counts: mx.array | None = None  # [max_rows, vocab] generated-token counts, once a row has penalties
        self._want_counts = False
        self._reset_rows: set[int] = set()
        self._cached: tuple[tuple, _BatchParams] | None = None
        self._draws: dict[tuple, object] = {}  # compiled draw functions by filter combination

    def configure(self, specs: list[RowSampling]) -> None:
        """Rows taken by new requests: their parameters, and zeroed penalty counts."""
        for spec in specs:
            if is_plain(spec):
                self.specs.pop(spec.row, None)
            else:
                self.specs[spec.row] = spec
            if spec.repetition_penalty != 1.0 or spec.presence_penalty or spec.frequency_penalty:
                self._want_counts = True
            self._reset_rows.add(spec.row)
        self._cached = None

    def warm_up(self, vocab: int, dtype: mx.Dtype) -> None:
        """Run every sampling feature once on a row of zero logits, then forget that row.

        MLX's CUDA gather and scatter kernels are compiled per dtype at their first use: the
        first sampled step of a fresh H200 service took 94 s (worker trace, session 12), so
        they are compiled here, before the service takes requests."""
        full = RowSampling(row=0, temperature=0.8, top_k=50, top_p=0.95, min_p=0.05, repetition_penalty=1.1,
                           presence_penalty=0.1, frequency_penalty=0.5, logit_bias=[(0, 0.5)], seed=1,
                           stop_ids=[0], logprobs=True, top_logprobs=5)
        nucleus = RowSampling(row=0, temperature=0.8, top_p=0.9, seed=1)  # top-p over the sorted vocabulary
        logits = mx.zeros((1, vocab), dtype=dtype)
        for spec in (full, nucleus):
            self.configure([spec])
            decode = DecodeBatch(rows=[0], token_ids=[0], positions=[1], slot_ids=[0], temperatures=[0.8],
                                 ban_stop=[0] if spec.stop_ids else [], mask_rows=[0],
                                 masks=[b"\xff" * (4 * -(-vocab // 32))])
            mx.eval(self.sample(logits, decode).arrays(), *([self.counts] if self.counts is not None else []))
        self.specs.clear()
        self.counts, self._want_counts, self._cached = None, False, None
        self._reset_rows.clear()

    def _prepare_counts(self, vocab: int) -> None:
        if self._want_counts and self.counts is None:
            self.counts = mx.zeros((self.max_rows, vocab), dtype=mx.float32)
        elif self.counts is not None and self._reset_rows:
            self.counts[mx.array(sorted(self._reset_rows), dtype=mx.int32)] = 0.0
        self._reset_rows.clear()

    def plain(self, decode: DecodeBatch) -> bool:
        """Whether every row of the batch is plain greedy (the fast path)."""
        if decode.ban_stop or decode.mask_rows or max(decode.temperatures) > 0:
            return False
        return not self.specs or not any(r in self.specs for r in decode.rows)

    def sample(self, logits: mx.array, decode: DecodeBatch) -> StepDraws:
        """The batch's tokens (lazy). ``logits``: [rows, vocab] for the rows of ``decode``, or
        more: rows past the batch's are padding (a batch padded to its row bucket), drawn as
        plain greedy rows and dropped. Padding keeps the compiled draw's shapes to the few
        bucket sizes: each new shape is a kernel build on a GPU."""
        n = len(decode.rows)
        self._prepare_counts(logits.shape[-1])
        if self.plain(decode):
            logits = logits[:n] if logits.shape[0] > n else logits
            logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
            draws = StepDraws(mx.argmax(logprobs, axis=-1).astype(mx.int32))
            self._count(decode, draws.tokens)
            return draws
        params = self._params(decode, logits.shape[-1], logits.shape[0])
        x = logits
        if params.bias is not None or decode.ban_stop or decode.mask_rows:
            x = self._restricted(x, decode, params)
        positions = mx.array(list(decode.positions) + [0] * (logits.shape[0] - n), dtype=mx.uint32)
        fn = self._core(params, logits.shape[-1])
        unused = params.inv_temp  # any array: an input whose feature is off is ignored
        outputs = fn(logits, x, self.counts if params.penalties else unused, params.rows,
                     _or(params.repetition, unused), _or(params.presence, unused), _or(params.frequency, unused),
                     positions, params.inv_temp, params.seeds, _or(params.top_k, unused), _or(params.top_p, unused),
                     _or(params.log_min_p, unused), params.sampled)
        tokens = outputs[0]
        draws = StepDraws(tokens[:n] if tokens.shape[0] > n else tokens)
        if params.logprobs:
            chosen, top_ids, top_values = (a[:n] for a in outputs[1:])
            draws.token_logprobs = chosen
            if params.top_n:
                draws.top_ids, draws.top_logprobs = top_ids, top_values
        self._count(decode, draws.tokens)
        return draws

    def _core(self, params: _BatchParams, vocab: int):
        """The compiled step for this batch's combination of features: penalties, the
        log-softmax, greedy and drawn tokens, and the logprobs outputs, as one function (the
        eager version launched some 40 kernels and as many Python calls per step)."""
        penalties = (params.repetition is not None, params.presence is not None, params.frequency is not None)
        draw = None
        if params.any_sampled:
            mode = ("top" if params.k_max < vocab
                    else "sorted" if params.top_p is not None or params.top_k is not None else "all")
            draw = (mode, params.k_max if mode == "top" else 0, params.top_k is not None, params.top_p is not None,
                    params.log_min_p is not None)
        top_n = params.top_n if params.logprobs else None
        key = (penalties, draw, top_n)
        fn = self._draws.get(key)
        if fn is None:
            fn = self._draws[key] = _maybe_compile(partial(_core, penalties, draw, top_n), self.compiled)
        return fn

    def _count(self, decode: DecodeBatch, tokens: mx.array) -> None:
        if self.counts is not None:
            rows = mx.array(decode.rows, dtype=mx.int32)
            self.counts = self.counts.at[rows, tokens].add(1.0)

    def _restricted(self, logits: mx.array, decode: DecodeBatch, params: _BatchParams) -> mx.array:
        """Logit bias, stop tokens masked for min_tokens, and structured-output masks (the
        penalties follow, inside the compiled step; a masked token stays -inf through them)."""
        x = logits
        if params.bias is not None:
            ri, ti, vals = params.bias
            bias = mx.zeros(x.shape, dtype=x.dtype).at[mx.array(ri), mx.array(ti)].add(mx.array(vals, dtype=x.dtype))
            x = x + bias
        if decode.ban_stop:
            ri, ti = [], []
            for i in decode.ban_stop:
                ids = params.specs[i].stop_ids
                ri.extend([i] * len(ids))
                ti.extend(ids)
            if ri:
                x = x.at[mx.array(ri), mx.array(ti)].add(mx.array(-float("inf"), dtype=x.dtype))
        if decode.mask_rows:
            if x is logits:
                x = mx.array(x)  # a new array: the assignment below must not change the raw logits
            index = mx.array(decode.mask_rows, dtype=mx.int32)
            allowed = grammar_allowed(decode.masks, x.shape[-1])
            x[index] = mx.where(allowed, x[index], mx.array(-float("inf"), dtype=x.dtype))
        return x

    def _params(self, decode: DecodeBatch, vocab: int, padded: int) -> _BatchParams:
        """The batch's parameters as arrays of ``padded`` rows (padding rows plain greedy)."""
        key = (tuple(decode.rows), tuple(id(self.specs.get(r, _PLAIN)) for r in decode.rows), padded)
        if self._cached is not None and self._cached[0] == key:
            return self._cached[1]
        pad = padded - len(decode.rows)
        specs = tuple(self.specs.get(r, _PLAIN) for r in decode.rows) + (_PLAIN,) * pad
        temps = [s.temperature if s is not _PLAIN else max(t, 0.0)
                 for s, t in zip(specs, list(decode.temperatures) + [0.0] * pad)]
        sampled = [t > 0 for t in temps]
        top_k = [s.top_k if 0 < s.top_k < vocab else vocab for s in specs]
        top_p = [s.top_p for s in specs]
        min_p = [s.min_p for s in specs]
        bias_rows, bias_ids, bias_vals = [], [], []
        for i, s in enumerate(specs):
            for token, value in s.logit_bias:
                bias_rows.append(i)
                bias_ids.append(token)
                bias_vals.append(value)
        rep = [s.repetition_penalty for s in specs]
        pres = [s.presence_penalty for s in specs]
        freq = [s.frequency_penalty for s in specs]
        penalties = any(r != 1.0 for r in rep) or any(pres) or any(freq)
        params = _BatchParams(
            specs=specs,
            rows=mx.array(list(decode.rows) + [decode.rows[0]] * pad, dtype=mx.int32),
            inv_temp=mx.array([1.0 / t if t > 0 else 1.0 for t in temps], dtype=mx.float32),
            sampled=mx.array(sampled),
            any_sampled=any(sampled),
            top_k=mx.array(top_k, dtype=mx.int32) if any(k < vocab for k in top_k) else None,
            k_max=max((k for k, on in zip(top_k, sampled) if on), default=vocab),
            top_p=mx.array(top_p, dtype=mx.float32) if any(p < 1.0 for p in top_p) else None,
            log_min_p=mx.array([math.log(p) if p > 0 else -math.inf for p in min_p], dtype=mx.float32)
            if any(min_p) else None,
            seeds=mx.array([[s.seed & 0xFFFFFFFF, (s.seed >> 32) & 0xFFFFFFFF] for s in specs], dtype=mx.uint32),
            bias=(bias_rows, bias_ids, bias_vals) if bias_rows else None,
            repetition=mx.array(rep, dtype=mx.float32) if any(r != 1.0 for r in rep) else None,
            presence=mx.array(pres, dtype=mx.float32) if any(pres) else None,
            frequency=mx.array(freq, dtype=mx.float32) if any(freq) else None,
            penalties=penalties,
            top_n=max(s.top_logprobs for s in specs),
            logprobs=any(s.logprobs for s in specs),
        )
        self._cached = (key, params)
        return params


def _or(value: mx.array | None, default: mx.array) -> mx.array:
    return value if value is not None else default


def _core(
    penalties: tuple[bool, bool, bool], draw: tuple | None, top_n: int | None,
    logits: mx.array, x: mx.array, counts: mx.array, rows: mx.array, repetition: mx.array, presence: mx.array,
    frequency: mx.array, positions: mx.array, inv_temp: mx.array, seeds: mx.array, top_k: mx.array,
    top_p: mx.array, log_min_p: mx.array, sampled: mx.array,
) -> tuple[mx.array, ...]:
    """One batch's tokens (and, for ``top_n`` not None, the logprobs outputs of ``_logprobs``
    from the raw ``logits``). ``x``: the logits after bias and masks; the penalties
    (repetition, presence, frequency as flagged) count each row's generated tokens in
    ``counts[rows]``; then the log-softmax, greedy, and where ``sampled``, ``_draw``'s token."""
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
    if draw is not None:
        drawn = _draw(*draw, logprobs, positions, inv_temp, seeds, top_k, top_p, log_min_p)
        tokens = mx.where(sampled, drawn, tokens)
    if top_n is None:
        return (tokens,)
    return (tokens, *_logprobs(top_n, logits, tokens))


def _draw(
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
    scores = values.astype(mx.float32) * inv_temp[:, None] + _gumbel(seeds, positions, ids)
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


def grammar_allowed(masks: list[bytes], vocab: int) -> mx.array:
    """(len(masks), vocab) bool from structured-output bitmasks: bit i of little-endian uint32
    word i // 32 allows token i; tokens past a mask's end are not allowed."""
    words = mx.array(np.frombuffer(b"".join(masks), dtype="<u4").reshape(len(masks), -1))
    bits = (words[:, :, None] >> mx.arange(32, dtype=mx.uint32)) & 1
    allowed = bits.reshape(len(masks), -1).astype(mx.bool_)
    if allowed.shape[1] < vocab:
        allowed = mx.concatenate([allowed, mx.zeros((len(masks), vocab - allowed.shape[1]), dtype=mx.bool_)], axis=1)
    return allowed[:, :vocab]


def _maybe_compile(fn, compiled: bool):
    return mx.compile(fn) if compiled else fn


def _logprobs(top_n: int, logits: mx.array, tokens: mx.array) -> tuple[mx.array, mx.array, mx.array]:
    """The chosen tokens' log-probabilities and the ``top_n`` best (ids, values), from the
    model's own log-softmax in float32, before any bias, penalty or filter."""
    raw = logits.astype(mx.float32)
    raw = raw - mx.logsumexp(raw, axis=-1, keepdims=True)
    chosen = mx.take_along_axis(raw, tokens[:, None], axis=-1)[:, 0]
    if not top_n:
        return chosen, chosen, chosen
    best, values = top_candidates(raw, top_n)
    return chosen, best, values


def _mix(x: mx.array) -> mx.array:
    """A 32-bit integer hash round (xor-shift-multiply), applied elementwise."""
    x = x ^ (x >> 16)
    x = x * 0x7FEB352D
    x = x ^ (x >> 15)
    x = x * 0x846CA68B
    return x ^ (x >> 16)


def _gumbel(seeds: mx.array, positions: mx.array, token_ids: mx.array) -> mx.array:
    """Gumbel noise for each (row, candidate token) from (row seed, position, token id) alone:
    a row's draws do not depend on the batch or on which candidates are scored."""
    token = token_ids.astype(mx.uint32)
    x = _mix(seeds[:, :1] ^ _mix(positions[:, None] * 0x9E3779B9 + 0x632BE5AB))
    x = _mix(x ^ (token * 0x85EBCA6B) ^ seeds[:, 1:2])
    x = _mix(x + 0x27D4EB2F)
    uniform = ((x >> 8).astype(mx.float32) + 0.5) * (1.0 / 16777216.0)
    return -mx.log(-mx.log(uniform))
