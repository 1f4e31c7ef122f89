"""Row-cache decode as one compiled MLX function (``mx.compile``), per batch shape.

A decode step of the row-cache path (the CPU's, and a CUDA GPU's for models the paged kernel
does not take, see ``row_step_compiled``) is host-bound for small models: Python builds
a graph of a few hundred small operations every step, and MLX's CPU stream runs only about a
hundred operations ahead of the host, so any host work between steps (the socket, the next
plan) leaves the device idle. Compiled, the model forward is traced once per shape: each step
replays the trace (no Python per layer) and elementwise chains are fused into single kernels,
so the step is fewer, larger operations. Measured on a 2-CPU VM with the tiny bench model:
0.09 ms of host build instead of 0.23, and 1.89 ms per step instead of 2.38 ms when the host
has 0.3 ms of other work per step.

Shapes must recur for a trace to be reused, so attention reads a bucketed length
(``length_bucket`` multiples) with a mask, rather than exactly the positions in use, and the
new K/V are scattered at (row, position) arrays rather than sliced at Python ints. A
sliding-window layer reads only a span that holds every row's window (``window_spans``; its
first position is an input array, so one trace serves every start).
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.worker.model.discovery import CacheLayout
from runtime.worker.paths.decode_plan import bucket_lengths, round_length
from runtime.worker.paths.pool_cache import (
    CacheStandIn,
    decode_mask,
    narrower,
    window_decode_mask,
)
from runtime.worker.paths.rows.parallel_attention import RowSplit
from runtime.worker.paths.rows.row_cache import RowCache
from runtime.worker.paths.trace_cache import MAX_TRACES, TraceCache
from runtime.worker.pools.aux_pool import AuxPool


def row_step_compiled(on_cpu: bool, padded: bool, cuda: bool) -> bool:
    """Whether the row-cache decode step is compiled (``compile_decode`` on). Compiled, its
    attention reads a bucketed length under a mask, so its shapes recur. The CPU's kernels give
    the same bits either way. A CUDA GPU's round a padded length differently in the last bits,
    so there it is compiled only where shapes are padded (``worker.pad_shapes``): Gemma 3 1B on
    an H100 ran 1.20x mlx-lm compiled against 0.81x uncompiled, whose host builds a graph of
    every layer each step (session 31). Not on Metal: never measured or checked there."""
    return on_cpu or (cuda and padded)


class _RowView(CacheStandIn):
    """Stands in for mlx-lm's KVCache (RotatingKVCache with a ``window``) in one attention
    layer inside the traced forward."""

    def __init__(self, keys: mx.array, values: mx.array, heads: mx.array, step: _StepArrays,
                 window: int | None = None) -> None:
        self.keys, self.values, self.heads, self.step, self.window = keys, values, heads, step, window

    @property
    def offset(self) -> mx.array:
        return self.step.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        s = self.step
        self.keys[s.row_index, self.heads, s.position_index] = keys[:, :, 0, :]
        self.values[s.row_index, self.heads, s.position_index] = values[:, :, 0, :]
        if s.compact:
            b = keys.shape[0]
            fetched = self.keys[:b, :, : s.length, :], self.values[:b, :, : s.length, :]
        else:
            fetched = self.keys[s.rows, :, : s.length, :], self.values[s.rows, :, : s.length, :]
        part = s.window_slice(self.window)
        if part is not None:  # a sliding-window layer reads the span that holds every row's window
            start, span = part
            fetched = tuple(mx.slice(a, start, [2], (a.shape[0], a.shape[1], span, a.shape[3])) for a in fetched)
        self.fetched = fetched
        return self.fetched

    @property
    def attends_decode(self) -> bool:
        """Whether the attention dispatcher should call ``decode_attend``: heads folded (see
        ``folded_attention``) or rows split over CPU streams (``RowSplit``)."""
        return self.step.fold or self.step.parts > 1

    def decode_attend(self, queries: mx.array, keys: mx.array, values: mx.array, scale: float,
                      mask: mx.array) -> mx.array:
        s = self.step
        # Folding is checked exact for boolean masks over one width (not DeepSeek-V3's float
        # rotary-score mask over its latent).
        fold = s.fold and mask.dtype == mx.bool_ and values.shape[-1] == queries.shape[-1]
        attend = folded_attention if fold else mlx_attention
        if s.parts > 1:
            assert s.split is not None
            return s.split.attend(attend, queries, keys, values, scale, mask, s.parts)
        return attend(queries, keys, values, scale, mask)

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> mx.array:
        window = narrower(window_size, self.window)
        return self.step.mask if window is None else self.step.window_mask(window, self.window)


class _StepArrays:
    """What every layer of one traced step shares: rows, positions, attended length, mask, and
    for each sliced sliding window its span's first position (``starts``, an input array, one per
    window of ``spans``) and length."""

    def __init__(self, rows: mx.array, positions: mx.array, compact: bool, length: int,
                 fold: bool, split: RowSplit | None, mask_rank: int = 4,
                 spans: tuple[tuple[int, int], ...] = (), starts: mx.array | None = None) -> None:
        self.rows, self.positions = rows, positions
        self.compact, self.length, self.fold = compact, length, fold
        self.mask_rank = mask_rank
        assert (starts is None) == (not spans)
        self.slices = {window: (starts[i : i + 1], span) for i, (window, span) in enumerate(spans)}
        self.split = split
        self.parts = split.parts(rows.shape[0]) if split is not None else 1
        self.row_index, self.position_index = rows[:, None], positions[:, None]  # scatter (row, head, position)
        index = mx.arange(length)[None, :]
        # (B, 1, 1, length) bool (rank 5 for 5-D grouped queries): each row sees the positions up to its own.
        self.mask = decode_mask(index <= positions[:, None], mask_rank)
        self.window_masks: dict[tuple[int, int | None], mx.array] = {}

    def window_slice(self, window: int | None) -> tuple[mx.array, int] | None:
        """(first position as a 1-element array, span) a layer of this window reads, or None: all."""
        return self.slices.get(window) if window is not None else None

    def window_mask(self, window: int, sliced_by: int | None = None) -> mx.array:
        """The mask of a layer with a sliding window (built once per window and trace), over the
        span of ``sliced_by``'s slice where that window is sliced."""
        if (window, sliced_by) not in self.window_masks:
            part = self.window_slice(sliced_by)
            if part is None:
                mask = window_decode_mask(self.mask, self.positions, window)
            else:
                start, span = part
                index = start + mx.arange(span)[None, :]
                # A padding row (at the scratch position, past the span) sees the span's last
                # ``window`` positions rather than none (its output is dropped).
                lowest = mx.minimum(self.positions, start + span - 1)[:, None] - window
                mask = decode_mask((index <= self.positions[:, None]) & (index > lowest), self.mask_rank)
            self.window_masks[(window, sliced_by)] = mask
        return self.window_masks[(window, sliced_by)]


def mlx_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array) -> mx.array:
    """MLX's own attention, as mlx-lm calls it for these caches."""
    return mx.fast.scaled_dot_product_attention(queries, keys, values, scale=scale, mask=mask)


def folded_attention(queries: mx.array, keys: mx.array, values: mx.array, scale: float, mask: mx.array) -> mx.array:
    """One-token attention as MLX's CPU fallback computes it, with each KV head's query heads
    folded into one matrix: (n_rep x D) @ (D x T) per KV head instead of n_rep (1 x D) @ (D x T)
    products. Same operations in the same order otherwise (scale first, bool mask filled with
    the dtype's min, precise softmax), and on this VM's OpenBLAS bit-identical to the fallback;
    a third fewer matrix calls made attention 1.5x faster at 16 rows.

    ``queries`` (B, H, 1, D); ``keys``/``values`` (B, KV, T, D); ``mask`` (B, 1, 1, T) bool.
    """
    b, n_heads, _, head_dim = queries.shape
    n_kv = keys.shape[1]
    q = (mx.array(scale, dtype=queries.dtype) * queries).reshape(b, n_kv, n_heads // n_kv, head_dim)
    scores = q @ keys.swapaxes(-1, -2)
    scores = mx.where(mask, scores, mx.array(mx.finfo(scores.dtype).min, dtype=scores.dtype))
    weights = mx.softmax(scores, axis=-1, precise=True)
    return (weights @ values).reshape(b, n_heads, 1, head_dim)


def folded_attention_is_exact(n_heads: int, n_kv_heads: int, head_dim: int, dtype: mx.Dtype,
                              lengths: list[int]) -> bool:
    """Whether ``folded_attention`` reproduces MLX's own attention bit for bit on this machine
    (its BLAS, this dtype and these head counts) at every attended length in ``lengths``.

    Folded products take other BLAS kernels than the reference's one-row ones. With the
    bundled BLAS and with OpenBLAS at 2 query heads per KV head the results are identical;
    OpenBLAS at 4 differs in the last bit. Greedy output must match mlx-lm's token for
    token, so folding is used only where this check passes.
    """
    kq, kk, kv = mx.random.split(mx.random.key(0), 3)  # a fixed key: the sampling RNG is not touched
    context = max(lengths)
    queries = mx.random.normal((2, n_heads, 1, head_dim), key=kq).astype(dtype)
    keys = mx.random.normal((2, n_kv_heads, context, head_dim), key=kk).astype(dtype)
    values = mx.random.normal((2, n_kv_heads, context, head_dim), key=kv).astype(dtype)
    scale = head_dim**-0.5
    for length in lengths:
        # Sliced out of a longer array, as decode slices the row cache; the second row is half masked.
        k, v = keys[:, :, :length], values[:, :, :length]
        mask = (mx.arange(length)[None, :] <= mx.array([length - 1, length // 2])[:, None])[:, None, None, :]
        folded = folded_attention(queries, k, v, scale, mask)
        reference = mx.fast.scaled_dot_product_attention(queries, k, v, scale=scale, mask=mask)
        if not mx.array_equal(folded, reference).item():
            return False
    return True


class CompiledDecode:
    """The model's decode forward over a ``RowCache``, compiled once per (rows, length bucket).

    ``forward`` takes the batch's input tokens, row indices and positions, writes the new
    K/V into the row cache (its arrays are replaced by the compiled function's outputs) and
    returns the last-position logits. Only for models whose every layer is attention.
    """

    def __init__(self, model: nn.Module, layout: CacheLayout, row_cache: RowCache, length_bucket: int,
                 max_context: int, fold_heads: bool, aux_pool: AuxPool | None = None,
                 attention_streams: int = 1) -> None:
        assert (aux_pool is not None) == layout.has_aux, "a hybrid model's decode needs its aux-state pool"
        self.model = model
        self.kv_index = list(layout.kv_index)
        self.nest = layout.nest
        self.windows = [layout.window(entry) for entry, i in enumerate(layout.kv_index) if i >= 0]
        self.distinct_windows = sorted({w for w in self.windows if w is not None})
        self.mask_rank = layout.mask_rank
        self.row_cache = row_cache
        self.aux_pool = aux_pool
        self.length_bucket = length_bucket
        self.max_context = max_context
        self.fold_heads = fold_heads  # attention through folded_attention (where MLX's SDPA is its fallback)
        self.split = RowSplit(attention_streams) if attention_streams > 1 else None
        self.traces = TraceCache(self._forward, MAX_TRACES)

    @classmethod
    def with_exact_folding(cls, model: nn.Module, layout: CacheLayout, row_cache: RowCache, length_bucket: int,
                           max_context: int, aux_pool: AuxPool | None, attention_streams: int = 1) -> CompiledDecode:
        """The compiled decode, attention heads folded where that is bit-exact on this machine
        for every layer shape of one width (``decode_attend`` folds only those)."""
        lengths = bucket_lengths(length_bucket, max_context)
        shapes = [s for s in dict.fromkeys(layout.kv_shapes) if s.same_widths]
        fold = bool(shapes) and all(folded_attention_is_exact(s.n_heads, s.n_kv_heads, s.head_dim, layout.kv_dtype,
                                                              lengths) for s in shapes)
        return cls(model, layout, row_cache, length_bucket, max_context, fold_heads=fold, aux_pool=aux_pool,
                   attention_streams=attention_streams)

    @staticmethod
    def supports(layout: CacheLayout) -> bool:
        """Every cache entry is attention, or the auxiliary state of a hybrid layer."""
        return any(i >= 0 for i in layout.kv_index) and all(
            i >= 0 or entry in layout.aux_layers for entry, i in enumerate(layout.kv_index))

    def bucket(self, length: int) -> int:
        """The attended length for a batch whose longest row needs ``length`` positions."""
        return round_length(length, self.length_bucket, self.max_context)

    def window_spans(self, positions: np.ndarray, length: int) -> tuple[tuple[tuple[int, int], ...], list[int]]:
        """For each sliding window, the span of positions its layers read in a step whose rows
        are at ``positions`` (real rows only) and attend to ``length``: ((window, span), ...) and
        each span's first position. A span holds every row's last ``window`` positions, its
        length the window rounded up to the length bucket, doubled until the rows' spread fits;
        a window whose span would be the whole length is not sliced. mlx-lm's RotatingKVCache
        attends to the window alone; reading the whole length under a mask left windowed models
        on the CPU behind it at long contexts (one 3,072-token prompt: Gemma 3 tiny 0.82x
        ``generate_step`` before, 1.38x sliced; session 32)."""
        lo, hi = int(positions.min()), int(positions.max())
        spans, starts = [], []
        for window in self.distinct_windows:
            span = -(-window // self.length_bucket) * self.length_bucket
            while span < hi - lo + window:
                span *= 2
            if span < length:
                spans.append((window, span))
                starts.append(max(0, min(lo - window + 1, length - span)))
        return tuple(spans), starts

    def _forward(self, tokens: mx.array, rows: mx.array, positions: mx.array, keys: list[mx.array],
                 values: list[mx.array], compact: bool, length: int, aux_slots: mx.array | None = None,
                 aux_states: list[list[mx.array]] | None = None, spans: tuple[tuple[int, int], ...] = (),
                 starts: mx.array | None = None):
        step = _StepArrays(rows, positions, compact, length, self.fold_heads, self.split, self.mask_rank, spans,
                           starts)
        views = [_RowView(k, v, h, step, w) for k, v, h, w in zip(keys, values, self.row_cache.heads, self.windows)]
        # A hybrid model's per-row states come from the traced aux-pool arrays and go back there.
        aux_pool = AuxPool(aux_states) if aux_states is not None else None
        aux = aux_pool.caches(aux_slots) if aux_pool is not None else []
        aux_iter = iter(aux)
        caches = self.nest([views[i] if i >= 0 else next(aux_iter) for i in self.kv_index])
        logits = self.model(tokens[:, None], cache=caches)[:, -1, :]
        if aux_pool is not None:
            aux_pool.store(aux, aux_slots)
        return logits, [v.keys for v in views], [v.values for v in views], aux_states

    def trace(self, rows: int) -> int:
        """Trace (without running) the compact step of ``rows`` rows at every length bucket, so
        no request waits for those traces later; how many."""
        tokens = mx.zeros((rows,), dtype=mx.int32)
        index = mx.arange(rows, dtype=mx.int32)
        c = self.row_cache
        lengths = bucket_lengths(self.length_bucket, self.max_context)
        aux = self.aux_pool.states if self.aux_pool is not None else None
        for length in lengths[: MAX_TRACES // 2]:  # half the cache at most: other shapes need room
            spans, starts = self.window_spans(np.full(rows, length - 1), length)  # rows in lockstep
            self.traces((rows, length, True, spans), tokens, index, index, c.keys, c.values, True, length,
                        index if aux is not None else None, aux, spans,
                        mx.array(starts, dtype=mx.int32) if spans else None)  # outputs dropped
        return min(len(lengths), MAX_TRACES // 2)

    def forward(self, tokens: mx.array, rows: mx.array, positions: np.ndarray, compact: bool, length: int,
                aux_slots: mx.array | None = None, real_positions: np.ndarray | None = None) -> mx.array:
        """Logits (B, vocab) of one decode step; the row cache holds the step's K/V afterwards,
        and the aux-state pool (hybrid models) each row's new state at ``aux_slots``.
        ``real_positions``: the requests' positions where padding rows fill the batch (default:
        every row is a request)."""
        c = self.row_cache
        length = self.bucket(length)
        aux = self.aux_pool.states if self.aux_pool is not None else None
        assert (aux_slots is None) == (aux is None)
        spans, starts = self.window_spans(positions if real_positions is None else real_positions, length)
        logits, keys, values, states = self.traces(
            (tokens.shape[0], length, compact, spans), tokens, rows, mx.array(positions.astype(np.int32)), c.keys,
            c.values, compact, length, aux_slots, aux, spans, mx.array(starts, dtype=mx.int32) if spans else None)
        c.keys[:], c.values[:] = keys, values
        if self.aux_pool is not None:
            self.aux_pool.states = states
        return logits

    def padded_rows(self, rows: list[int]) -> int:
        """Rows 0..R-1 for a scattered batch to run as a compact one (its missing rows as
        padding), or 0 where gathering its rows costs less.

        A scattered batch gathers its rows' K/V out of the row cache every layer and step; a
        compact one attends to a slice. On this VM's 2 CPUs (tiny model, 600 positions) 48
        scattered rows took 156 ms a step, the same 48 as rows 0..47 67 ms and all 64 rows
        64 ms. So a batch that fills at least half of rows 0..R-1 (R rounded up to a multiple
        of 8, for shapes that recur) runs compact; hybrid models keep the gather (a padding
        row would write another row's auxiliary state)."""
        if self.aux_pool is not None:
            return 0
        top = max(rows) + 1
        padded = min(-(-top // 8) * 8, self.row_cache.rows)
        return padded if 2 * len(rows) >= padded else 0

    def forward_padded(self, tokens: mx.array, rows: list[int], positions: list[int], length: int,
                       padded: int) -> mx.array:
        """``forward`` of a scattered batch as the compact batch of rows 0..``padded``-1: the
        missing rows take token 0 and write their K/V to the row cache's scratch position
        (past ``max_context``, never attended); their logits are dropped. Each real row's
        attention and projections are the same operations on the same values."""
        index = mx.array(rows, dtype=mx.int32)
        all_tokens = mx.zeros((padded,), dtype=tokens.dtype)
        all_tokens[index] = tokens
        all_positions = np.full(padded, self.row_cache.max_context, dtype=np.int32)
        all_positions[rows] = positions
        logits = self.forward(all_tokens, mx.arange(padded, dtype=mx.int32), all_positions, True, length,
                              real_positions=np.asarray(positions))
        return logits[index]
