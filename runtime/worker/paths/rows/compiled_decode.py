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
sliding-window layer gathers each row's last ``window`` positions (``StepArrays.gathers``), as
mlx-lm's RotatingKVCache holds the window alone, wherever the rows are.
"""

from __future__ import annotations

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.worker.model.discovery import CacheLayout
from runtime.worker.paths.decode_plan import bucket_lengths, round_length
from runtime.worker.paths.rows.parallel_attention import RowSplit
from runtime.worker.paths.rows.row_attention import folded_attention_is_exact
from runtime.worker.paths.rows.row_cache import RowCache
from runtime.worker.paths.rows.row_view import RowView, StepArrays
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


class CompiledDecode:
    """The model's decode forward over a ``RowCache``, compiled once per (rows, length bucket).

    ``forward`` takes the batch's input tokens, row indices and positions, writes the new
    K/V into the row cache (its arrays are replaced by the compiled function's outputs) and
    returns the last-position logits. For models whose every layer is attention or the
    recurrent state of a hybrid layer: those states are inputs and outputs of the step,
    batch-major (the aux pool's resident batch, ``AuxPool.batch_states``; ``aux_pool``: their
    shapes, for the warm-up traces).
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

    def _forward(self, tokens: mx.array, rows: mx.array, positions: mx.array, keys: list[mx.array],
                 values: list[mx.array], compact: bool, length: int,
                 aux_states: list[list[mx.array]] | None = None):
        # Windows shorter than the attended length read each row's window alone.
        gathered = tuple(w for w in self.distinct_windows if w < length)
        step = StepArrays(rows, positions, compact, length, self.fold_heads, self.split, self.mask_rank, gathered)
        views = [RowView(k, v, h, step, w) for k, v, h, w in zip(keys, values, self.row_cache.heads, self.windows)]
        aux = AuxPool.wrap(aux_states) if aux_states is not None else []
        aux_iter = iter(aux)
        caches = self.nest([views[i] if i >= 0 else next(aux_iter) for i in self.kv_index])
        logits = self.model(tokens[:, None], cache=caches)[:, -1, :]
        states = [c.cache for c in aux] if aux_states is not None else None
        return logits, [v.keys for v in views], [v.values for v in views], states

    def trace(self, rows: int) -> int:
        """Trace (without running) the compact step of ``rows`` rows at every length bucket, so
        no request waits for those traces later; how many."""
        tokens = mx.zeros((rows,), dtype=mx.int32)
        index = mx.arange(rows, dtype=mx.int32)
        c = self.row_cache
        lengths = bucket_lengths(self.length_bucket, self.max_context)
        states = self.aux_pool.zero_batch(rows) if self.aux_pool is not None else None
        for length in lengths[: MAX_TRACES // 2]:  # half the cache at most: other shapes need room
            self.traces((rows, length, True), tokens, index, index, c.keys, c.values, True, length,
                        states)  # outputs dropped
        return min(len(lengths), MAX_TRACES // 2)

    def forward(self, tokens: mx.array, rows: mx.array, positions: np.ndarray, compact: bool, length: int,
                aux_states: list[list[mx.array]] | None = None) -> tuple[mx.array, list[list[mx.array]] | None]:
        """Logits (B, vocab) of one decode step, and (hybrid models) each row's new recurrent
        states from its ``aux_states``; the row cache holds the step's K/V afterwards."""
        c = self.row_cache
        length = self.bucket(length)
        assert (aux_states is None) == (self.aux_pool is None)
        logits, keys, values, states = self.traces(
            (tokens.shape[0], length, compact), tokens, rows, mx.array(positions.astype(np.int32)), c.keys,
            c.values, compact, length, aux_states)
        c.keys[:], c.values[:] = keys, values
        return logits, states

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
        logits, _ = self.forward(all_tokens, mx.arange(padded, dtype=mx.int32), all_positions, True, length)
        return logits[index]
