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
from runtime.worker.sampling_ops import or_default, sample_step

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

    def read_logprobs(self) -> tuple[list, list, list] | None:
        """The logprobs as plain lists (chosen, top ids, top values), once evaluated; None if no row asked."""
        if self.token_logprobs is None:
            return None
        return (self.token_logprobs.tolist(), self.top_ids.tolist() if self.top_ids is not None else [],
                self.top_logprobs.tolist() if self.top_logprobs is not None else [])


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
        fn = self._step_function(params, logits.shape[-1])
        unused = params.inv_temp  # any array: an input whose feature is off is ignored
        positions = (mx.array(list(decode.positions) + [0] * (logits.shape[0] - n), dtype=mx.uint32)
                     if params.any_sampled else unused)  # the draws' noise is keyed by position
        outputs = fn(logits, x, self.counts if params.penalties else unused, params.rows,
                     or_default(params.repetition, unused), or_default(params.presence, unused), or_default(params.frequency, unused),
                     positions, params.inv_temp, params.seeds, or_default(params.top_k, unused), or_default(params.top_p, unused),
                     or_default(params.log_min_p, unused), params.sampled)
        tokens = outputs[0]
        draws = StepDraws(tokens[:n] if tokens.shape[0] > n else tokens)
        if params.logprobs:
            chosen, top_ids, top_values = (a[:n] for a in outputs[1:])
            draws.token_logprobs = chosen
            if params.top_n:
                draws.top_ids, draws.top_logprobs = top_ids, top_values
        self._count(decode, draws.tokens)
        return draws

    def _step_function(self, params: _BatchParams, vocab: int):
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
            fn = self._draws[key] = _maybe_compile(partial(sample_step, penalties, draw, top_n), self.compiled)
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


