"""The paged-kernel decode step (the CUDA path) as one compiled MLX function per shape.

On a GPU a single stream's decode step is host-bound: building the graph layer by layer in
Python took 0.9-1.3 ms of a 2.5-4 ms step on the lent H200 hosts (worker trace), and
MLX's submit most of the rest. Compiled, each step replays a trace made once per (rows,
kernel launch shape): no Python per layer, and elementwise chains fused. The decode tail's
length is an input array of the trace, not a shape (``DecodeTail``), so a row class needs no
trace per tail length.

Nothing is written in place, as in the uncompiled path: the kernel reads the pool through the
device slot table plus the decode tail (``DecodeTail``) and writes the tail extended by the
step's new K/V, a new array per step. So the step can still be submitted before the previous
one is read back. A hybrid model's recurrent states are inputs and outputs too, batch-major
(the aux pool's resident batch, ``AuxPool.batch_states``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable

import mlx.core as mx
import mlx.nn as nn

from runtime.worker.model.discovery import CacheLayout
from runtime.worker.model.kernel_rope import DeferredOffset, RopeSpec
from runtime.worker.paths.cuda.decode_tail import DecodeTail
from runtime.worker.paths.cuda.window_view import cached_view
from runtime.worker.paths.paged_attention import PagedAttention
from runtime.worker.paths.pool_cache import CacheStandIn, ForwardBatch
from runtime.worker.paths.trace_cache import MAX_TRACES, TraceCache
from runtime.worker.pools.aux_pool import AuxPool
from runtime.worker.pools.kv_pool import KVPool


class _Step:
    """What every layer of one traced step shares; ``new_keys``/``new_values`` collect the tail."""

    def __init__(self, attention: PagedAttention, positions: mx.array, lengths: mx.array, table: mx.array,
                 table_rows: mx.array, pool_keys: list[mx.array], pool_values: list[mx.array],
                 tail_keys: list[mx.array], tail_values: list[mx.array], tail_len: mx.array,
                 launch: tuple[int, int], rope: tuple[RopeSpec | None, ...] | None) -> None:
        self.attention, self.positions, self.lengths, self.rope = attention, positions, lengths, rope
        self.table, self.table_rows, self.launch = table, table_rows, launch
        self.pool_keys, self.pool_values = pool_keys, pool_values
        self.tail_keys, self.tail_values, self.tail_len = tail_keys, tail_values, tail_len
        n = len(pool_keys)
        self.new_keys: list[mx.array | None] = [None] * n
        self.new_values: list[mx.array | None] = [None] * n
        self.window_views: dict[int, tuple[mx.array, mx.array, mx.array]] = {}

    def kernel_view(self, window: int | None) -> tuple[mx.array, mx.array, mx.array]:
        """The kernel's (table, table rows, lengths) for a layer of this sliding ``window`` (None:
        every position), built once per window and trace (``window_view``)."""
        return cached_view(self.window_views, self.table, self.table_rows, self.lengths, window)


class _TailView(CacheStandIn):
    """Stands in for mlx-lm's KVCache in one attention layer inside the traced step."""

    paged = True  # the attention dispatcher sends the layer's attention call to paged_attend

    def __init__(self, kv_layer: int, step: _Step, window: int | None = None) -> None:
        self.kv_layer, self.step, self.window = kv_layer, step, window
        self.new: tuple[mx.array, mx.array] | None = None  # this step's K/V
        # The kernel rotates: the layer's rotary module sees this and leaves its input as it is.
        rotates = step.rope is not None and step.rope[kv_layer] is not None
        self.deferred = DeferredOffset(step.positions) if rotates else None

    @property
    def offset(self) -> mx.array | DeferredOffset:
        return self.deferred if self.deferred is not None else self.step.positions

    def update_and_fetch(self, keys: mx.array, values: mx.array) -> tuple[mx.array, mx.array]:
        self.new = (keys, values)
        return keys, values  # paged_attend reads the pool and the tail, and appends to the tail

    def paged_attend(self, queries: mx.array, scale: float, sinks: mx.array | None = None) -> mx.array:
        s, i = self.step, self.kv_layer
        assert self.new is not None
        rope = None
        if self.deferred is not None and self.deferred.calls:  # (a deferred offset: the layer has a spec)
            if self.deferred.calls != 2:  # kernel_rope's load-time probe rules this out
                raise RuntimeError(f"KV layer {i}: its rotary module ran {self.deferred.calls} times in a decode "
                                   "step whose kernel rotates (2 expected: queries and keys)")
            rope = (s.rope[i], s.positions)  # else the layer rotated nothing: no RoPE in it
            assert rope[0] is not None
        table, table_rows, lengths = s.kernel_view(self.window)
        out, s.new_keys[i], s.new_values[i] = s.attention.attend_appending(
            queries, s.pool_keys[i], s.pool_values[i], table, table_rows, lengths, s.tail_keys[i],
            s.tail_values[i], s.tail_len, *self.new, scale, s.launch, rope, sinks)
        return out

    def make_mask(self, n: int, return_array: bool = False, window_size: int | None = None) -> None:
        return None  # the kernel takes each row's length


class CompiledPagedDecode:
    """``forward(tokens, batch)``: logits of a kernel-path decode step whose bookkeeping
    (``AttentionPaths.decode_batch``: table, tail flush, lengths, launch shape) is done; the
    step's K/V become the tail's new arrays. For models whose every layer is attention or the
    recurrent state of a hybrid layer (``aux_pool``: the states' shapes, for warm-ups).
    ``rope`` (each KV layer's spec, from ``kernel_rope.defer_rope``; None for a layer that
    rotates itself): the kernel rotates those layers' queries and new keys, their rotary
    modules do not."""

    def __init__(self, model: nn.Module, layout: CacheLayout, pool: KVPool, attention: PagedAttention,
                 tail: DecodeTail, rope: tuple[RopeSpec | None, ...] | None = None,
                 aux_pool: AuxPool | None = None) -> None:
        assert all(i >= 0 or entry in layout.aux_layers for entry, i in enumerate(layout.kv_index)), \
            "compiled decode needs every layer to be attention or a hybrid layer's state"
        assert (aux_pool is not None) == layout.has_aux, "a hybrid model's decode needs its aux-state pool"
        self.model, self.kv_index, self.rope = model, list(layout.kv_index), rope
        self.windows = [layout.window(entry) for entry in range(len(self.kv_index))]
        self.nest = layout.nest
        self.pool, self.attention, self.tail, self.aux_pool = pool, attention, tail, aux_pool
        self.traces = TraceCache(self._forward, MAX_TRACES)

    def _forward(self, tokens: mx.array, positions: mx.array, lengths: mx.array, table: mx.array,
                 table_rows: mx.array, pool_keys: list[mx.array], pool_values: list[mx.array],
                 tail_keys: list[mx.array], tail_values: list[mx.array], tail_len: mx.array,
                 launch: tuple[int, int], aux_states: list[list[mx.array]] | None = None):
        step = _Step(self.attention, positions, lengths, table, table_rows, pool_keys, pool_values, tail_keys,
                     tail_values, tail_len, launch, self.rope)
        aux = iter(AuxPool.wrap(aux_states) if aux_states is not None else [])
        caches = [_TailView(i, step, self.windows[entry]) if i >= 0 else next(aux)
                  for entry, i in enumerate(self.kv_index)]
        logits = self.model(tokens[:, None], cache=self.nest(caches))[:, -1, :]
        states = [c.cache for c in caches if not isinstance(c, _TailView)] if aux_states is not None else None
        return logits, step.new_keys, step.new_values, states

    def forward(self, tokens: mx.array, batch: ForwardBatch,
                aux_states: list[list[mx.array]] | None = None) -> tuple[mx.array, list[list[mx.array]] | None]:
        """The step's logits, and (hybrid models) each row's new recurrent states from its
        ``aux_states`` (per aux entry, per state, batch-major)."""
        assert batch.tail is self.tail and batch.table is not None and batch.table_rows is not None
        assert batch.lengths is not None and batch.launch is not None and isinstance(batch.offset, mx.array)
        assert batch.tail_len is not None and (aux_states is None) == (self.aux_pool is None)
        rows, t, shape = tokens.shape[0], self.tail, self.pool.shape
        tail_keys, tail_values = t.old(rows, shape.n_kv_heads, shape.head_dim, self.pool.dtype)
        logits, keys, values, states = self._traced(
            (rows, batch.launch), tokens, batch.offset, batch.lengths, batch.table, batch.table_rows, self.pool.keys,
            self.pool.values, tail_keys, tail_values, batch.tail_len, batch.launch, aux_states)
        t.keys[:], t.values[:] = keys, values
        return logits, states

    def _unused_states(self, rows: int) -> list[list[mx.array]] | None:
        """Zero states of ``rows`` rows (a warm-up's inputs), or None (no hybrid layers)."""
        return self.aux_pool.zero_batch(rows) if self.aux_pool is not None else None

    def _traced(self, key: tuple, *args):
        """``self.traces`` at ``key``. A model whose forward cannot be traced with its rotation
        left to the kernel (something outside its rotary modules reads the offset as a number,
        which ``rope_probe``'s one-module run cannot see) is traced again rotating itself, and
        keeps that; any other failure is raised."""
        try:
            return self.traces(key, *args)
        except (TypeError, ValueError, AttributeError) as exc:
            if self.rope is None:
                raise
            print(f"runtime worker: the decode step cannot leave RoPE to the kernel ({type(exc).__name__}: {exc}); "
                  "the model rotates its queries and keys itself", file=sys.stderr, flush=True)
            self.rope = None
            self.traces = TraceCache(self._forward, MAX_TRACES)
            return self.traces(key, *args)

    def trace(self, rows: int, table: mx.array, launches: list[tuple[int, int]]) -> int:
        """Trace (without running) the step of ``rows`` rows over the device slot ``table`` at
        every launch shape, so no request waits for those traces later; how many."""
        zeros = mx.zeros((rows,), dtype=mx.int32)
        tail_keys, tail_values = self._unused_tail(rows)
        count = 0
        for launch in launches:
            if count == MAX_TRACES // 2:
                return count  # half the cache at most: other shapes need room
            self._traced((rows, launch), zeros, zeros, zeros + 1, table, zeros, self.pool.keys, self.pool.values,
                         tail_keys, tail_values, zeros[:1], launch, self._unused_states(rows))  # outputs dropped
            count += 1
        return count

    def _unused_tail(self, rows: int) -> tuple[list[mx.array], list[mx.array]]:
        shape = self.pool.shape
        return self.tail.unused(rows, shape.n_kv_heads, shape.head_dim, self.pool.dtype)

    def warm_rows(self, row_sizes: list[int], table: mx.array, launches: Callable[[int], list[tuple[int, int]]],
                  budget_s: float) -> int:
        """Trace and run once the first step of a new batch (tail length 1) of every row class
        in ``row_sizes``, at each of its launch shapes, until ``budget_s`` is spent: mixed
        traffic meets a new row class every few steps, and a step's first run costs tens of ms
        (seconds where its kernels are not built yet) inside someone's request otherwise.
        Writes nothing (the outputs are the tail's new arrays, dropped); how many traces."""
        deadline = time.perf_counter() + budget_s
        count = 0
        for rows in row_sizes:
            zeros = mx.zeros((rows,), dtype=mx.int32)
            tail_keys, tail_values = self._unused_tail(rows)
            states = self._unused_states(rows)
            for launch in launches(rows):
                if time.perf_counter() > deadline or len(self.traces) >= MAX_TRACES * 3 // 4:
                    return count
                logits, keys, values, new_states = self._traced((rows, launch), zeros, zeros, zeros + 1, table, zeros,
                                                                self.pool.keys, self.pool.values, tail_keys,
                                                                tail_values, zeros[:1], launch, states)
                mx.eval(logits, keys, values, new_states or [])
                count += 1
        return count
