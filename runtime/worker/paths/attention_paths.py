"""Where a forward pass's new K/V go and what its attention reads, for the worker's three paths.

* CUDA paged kernel (a GPU, attention routed by ``attention_patch``): decode reads the pool
  through a device copy of the slot table and keeps its new K/V in a ``DecodeTail``.
* Row cache (where the kernel does not apply and a dense copy fits): decode attends to a slice
  of a ``RowCache``; its K/V reach the pool later (``DeferredSteps``), before anything reads it.
* Otherwise: K/V are gathered from the pool into a masked batch.

Prefill writes the pool (the prefix cache's source of truth) on every path.
"""

from __future__ import annotations

import sys

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.protocol.worker import DecodeBatch, PrefillChunk
from runtime.worker.model import attention_patch
from runtime.worker.model.discovery import CacheLayout
from runtime.worker.model.kernel_rope import RopeSpec, defer_rope
from runtime.worker.paths.cuda.cubin_kernels import prefetching
from runtime.worker.paths.cuda.decode_tail import DecodeTail, tail_capacity
from runtime.worker.paths.cuda.kernel_check import check_kernel_rope, check_paged_kernel
from runtime.worker.paths.cuda.kernel_launch import launch_shape
from runtime.worker.paths.decode_plan import DecodePlan, row_bucket
from runtime.worker.paths.deferred_steps import DeferredSteps
from runtime.worker.paths.mixed_prefill import mixed_prefill_batch, padded_write_slots
from runtime.worker.paths.paged_attention import PagedAttention
from runtime.worker.paths.pool_cache import ForwardBatch, WindowGather, decode_mask
from runtime.worker.paths.prefill_shapes import front_padded_mask, key_length
from runtime.worker.paths.rows.row_cache import MAX_BYTES, RowCache, RowSpan
from runtime.worker.pools.kv_pool import KVPool

TAIL_STEPS = 16  # decode steps a DecodeTail holds before it is flushed into the pool
# A batch that only lost rows keeps the tail (``DecodeTail.narrow``) rather than flush it and wait
# for the step before it (on an H100's 8B mixed traffic such steps took 19 against 10 ms).
NARROW_TAIL = True
PENDING_STEPS = 64  # row-cache decode steps not yet copied into the pool, at most


class AttentionPaths:
    """The host slot table, and the path-specific state: kernel + tail, row cache, or neither.

    The paged decode (the CUDA kernel, or its gathered fallback) answers a module's attention
    call from the pool, so it is taken only where that call is what attends: every attention
    module attends through it to the K/V its cache returned (``layout.routed``), no layer
    attends to K/V another layer's cache returned (``layout.shares_kv``: handed through the
    forward, such a call reaches no cache; read back with ``keys_and_values()``, it would get the
    step's new K/V alone, all a paged view's ``update_and_fetch`` returns), every sliding window
    holds the decode tail (the kernel reads a window through a narrowed table, ``window_view``;
    the gathered fallback has no window, so windowed models take it only as the pool views'
    masked gather), and every layer has one shape (``layout.kv_shape``) with keys and values of
    one width. Attention sinks (gpt-oss) take the kernels' sink variant. Every other model
    (latent attention, layers of several shapes, the KV-shared layers of Gemma 4 and Gemma 3n)
    takes the row cache, whose layers each have their own shape, or the pool gather.

    ``row_cache``: None picks the row cache where the kernel does not apply and it fits in
    ``MAX_BYTES``; True forces it, False forbids it. Hybrid models take the decode tail too:
    their recurrent states stay out of the pool while a batch decodes (``AuxPool.keep``).
    """

    def __init__(
        self,
        model: nn.Module,
        layout: CacheLayout,
        pool: KVPool,
        max_rows: int,
        max_context: int,
        row_cache: bool | None,
        length_bucket: int = 128,
    ) -> None:
        self.pool = pool
        self.mask_rank = layout.mask_rank
        self.max_rows, self.max_context = max_rows, max_context
        self.slot_table = np.zeros((max_rows, max_context), dtype=np.int32)
        routed = bool(layout.attention_layers) and attention_patch.install(model, layout.attn_attr)
        self.windowed = layout.windowed
        self.sinks = layout.sinks  # the kernels with attention sinks (gpt-oss)
        # The one sliding window (discovery refuses several) a pool-gather decode narrows its
        # windowed layers' K/V to; not where a layer reads another's K/V back whole.
        self.gather_window = None if layout.shares_kv else next((w for w in layout.windows if w is not None), None)
        shape = layout.kv_shape
        # A sliding window the decode tail fits in: the kernel reads each row's last W positions
        # through a narrowed table (``window_view``), the tail being always the newest of them.
        windows_fit = all(w is None or w >= tail_capacity(TAIL_STEPS) for w in layout.windows)
        paged = (routed and layout.routed and not layout.shares_kv and windows_fit and shape is not None
                 and shape.same_widths)
        self.attention = PagedAttention(PagedAttention.kernel_available()) if paged else None
        kernel = self.attention is not None and shape is not None and self.attention.supports(shape.head_dim)
        if kernel and (problem := self._check_kernel(length_bucket)):
            print(f"runtime worker: the paged attention kernel failed its start-up check ({problem}); "
                  "decode attends through gathered K/V instead", file=sys.stderr, flush=True)
            self.attention, kernel = PagedAttention(False), False
        if self.windowed and not kernel:
            self.attention = None  # the gathered fallback would not window: the pool views' masks do
        self.row_cache: RowCache | None = None
        if (not kernel if row_cache is None else row_cache) and layout.attention_layers:
            n_layers = len(layout.attention_layers)
            size = RowCache.nbytes_for(n_layers, max_rows, max_context, layout.kv_shapes, layout.kv_dtype)
            if size <= MAX_BYTES or row_cache:
                self.row_cache = RowCache(n_layers, max_rows, max_context, layout.kv_shapes, layout.kv_dtype)
                self.attention, kernel = None, False  # decode attends with mlx-lm's own call
        self.masked = not kernel
        # The kernel reads slots from a device copy of the table (one extra all-padding row for
        # padding batch rows), so a decode step uploads O(batch) ints, not O(batch * length).
        self.device_table = mx.zeros((max_rows + 1, max_context), dtype=mx.int32) if kernel else None
        self.tail = DecodeTail(len(layout.attention_layers), TAIL_STEPS) if kernel else None
        self.pending = DeferredSteps(PENDING_STEPS)  # row-cache decode steps not in the pool yet
        self.length_bucket = length_bucket
        self.rope: tuple[RopeSpec | None, ...] | None = None  # set by kernel_rope: the kernel rotates

    def _check_kernel(self, length_bucket: int) -> str | None:
        """The paged kernel's start-up check (``check_paged_kernel``) of the kernel kind decode
        uses (appending to the decode tail) at one launch of every kernel the warm-up
        builds anyway (one per warps count, unsplit and split; the split count is a grid size),
        so a kernel that cannot launch (too many registers for its block) is found here."""
        assert self.attention is not None
        shape = self.pool.shape
        n_rep = shape.n_heads // shape.n_kv_heads
        launches = self._kernel_launches(length_bucket)
        self._prefetch(launches)
        return check_paged_kernel(self.attention, self.pool.dtype, shape.n_kv_heads, n_rep, shape.head_dim,
                                  launches, True, self.sinks)

    def _prefetch(self, launches: list[tuple[int, int]], specs: tuple[RopeSpec, ...] = ()) -> None:
        """Start the NVRTC builds of the kernels ``launches`` use (rotating as each of ``specs``
        says, if any) side by side in build processes, so the check after them waits for builds that
        ran together; only where our kernels' modules are written ahead (``cubin_kernels.prefetching``)."""
        assert self.attention is not None
        shape = self.pool.shape
        n_rep = shape.n_heads // shape.n_kv_heads
        with prefetching() as ahead:
            if not ahead:
                return
            for spec in specs or (None,):
                self.attention.warm_up(self.pool.dtype, shape.n_kv_heads, n_rep, shape.head_dim, set(launches),
                                       tail=True, rope=spec, sinks=self.sinks)

    def _kernel_launches(self, length_bucket: int) -> list[tuple[int, int]]:
        """One launch of every kernel decode builds (one per warps count, unsplit and split)."""
        shape = self.pool.shape
        n_rep = shape.n_heads // shape.n_kv_heads
        variants = PagedAttention.variants(shape.n_kv_heads, n_rep, shape.head_dim, self.max_rows, self.max_context,
                                           row_bucket, length_bucket)
        kernels: dict[tuple[bool, int], tuple[int, int]] = {}
        for splits, warps in sorted(variants):  # the most split launch of each kernel last, so kept
            kernels[(splits > 1, warps)] = (splits, warps)
        return sorted(kernels.values())

    def kernel_rope(self, model: nn.Module, layout: CacheLayout) -> tuple[RopeSpec | None, ...] | None:
        """Let the appending kernel rotate the queries and new keys of a compiled decode step
        (``kernel_rope``) where the model allows it and the rotating kernel passes its start-up
        check (``check_kernel_rope``); each KV layer's spec, else None (the model rotates)."""
        if self.tail is None or self.device_table is None or self.attention is None or self.sinks:
            return None  # (the rotating kernels have no sink variant)
        specs = defer_rope(model, layout)
        if specs is None:
            return None
        shape = self.pool.shape
        launches = self._kernel_launches(self.length_bucket)
        kinds = {(s.mode, s.dims, s.traditional): s for s in specs if s is not None}  # each rotating kernel
        self._prefetch(launches, tuple(kinds.values()))
        problem = check_kernel_rope(self.attention, self.pool.dtype, shape.n_kv_heads,
                                    shape.n_heads // shape.n_kv_heads, shape.head_dim,
                                    tuple(s for s in specs if s is not None), launches, self.max_context)
        if problem is not None:
            print(f"runtime worker: the paged kernel's RoPE failed its start-up check ({problem}); "
                  "the model rotates its queries and keys itself", file=sys.stderr, flush=True)
            return None
        self.rope = specs
        return specs

    @property
    def dense(self) -> bool:
        """Decode attends to the row cache."""
        return self.row_cache is not None

    def set_table(self, row: int, start: int, slots: list[int]) -> None:
        """Record the slots of positions ``start..`` of ``row`` (host table, and the device copy)."""
        self.slot_table[row, start : start + len(slots)] = slots
        if self.device_table is not None:
            self.device_table[row, start : start + len(slots)] = mx.array(slots, dtype=mx.int32)

    def admit_chunk(self, chunk: PrefillChunk) -> None:
        """Table entries (and, with a row cache, the cached prefix's K/V) for a prefill chunk."""
        if chunk.prefix_slots:
            self.set_table(chunk.row, 0, chunk.prefix_slots)
            if self.row_cache is not None:
                self.row_cache.fill_prefix(self.pool, chunk.row, mx.array(chunk.prefix_slots, dtype=mx.int32))
        if chunk.token_ids:
            self.set_table(chunk.row, chunk.start, chunk.slot_ids)

    def prefill_batch(self, group: list[PrefillChunk], length: int, rows: int = 0, pad_keys: bool = False
                      ) -> ForwardBatch:
        """One forward over ``group``'s chunks (one start, or each its own: ``mixed_prefill``),
        each padded at the end to ``length``, with padding rows up to ``rows``.

        Padding positions (and padding rows) write their K/V to the padding slot 0; in the row
        cache they land past the row's length, which decode overwrites before it ever attends
        there. ``pad_keys`` (paged-kernel models, on a GPU): past position 0 the gathered keys
        are rounded up too (``prefill_shapes.key_length``), padded at the front and masked.
        """
        start = max(c.start for c in group)
        rows = max(rows, len(group))
        # Keys each row gathers past position 0: rounded up where ``pad_keys``, else exact.
        keys = key_length(start, length, self.max_context) if pad_keys and self.attention is not None else start + length
        if any(c.start != start for c in group):  # a hybrid's round (``Engine.mixed_starts``)
            assert self.row_cache is None and self.gather_window is None
            return mixed_prefill_batch(self.slot_table, group, length, rows, keys, self.mask_rank)
        gather, mask, front_padding = None, None, None
        if start and self.row_cache is None:
            # Past position 0 a chunk attends to its prefix (the row cache has it in place).
            pad = keys - start - length
            index = np.zeros((rows, pad + start + length), dtype=np.int32)
            index[: len(group), pad:] = self.slot_table[[c.row for c in group], : start + length]
            for i, c in enumerate(group):
                index[i, pad + start + len(c.token_ids) :] = 0
            gather = mx.array(index)
            if pad:
                front_padding = (start, length, pad + start + length)
                mask = front_padded_mask(*front_padding, self.mask_rank)
        return ForwardBatch(
            write_slots=padded_write_slots(group, length, rows),
            gather_index=gather,
            offset=start,
            mask=mask,
            front_padding=front_padding,
            rows=RowSpan(self.row_cache, [c.row for c in group], start) if self.row_cache is not None else None,
            # Past position 0 a chunk's windowed layers read their window back, not the prefix, from
            # the row cache or the pool. (A windowed model's prefill is never fused: ``fuse_prefill``.)
            # Once the window is behind the chunk its keys number W - 1 + the chunk's: shapes recur.
            prefill_window=self.gather_window if start else None,
        )

    def decode_batch(self, decode: DecodeBatch, plan: DecodePlan) -> tuple[ForwardBatch, bool]:
        """The forward batch of a decode step, and whether building it updated pools in place."""
        rows, positions, lockstep = plan.rows, plan.positions, plan.lockstep
        positions32 = positions.astype(np.int32)
        offsets: int | mx.array = int(positions[0]) if lockstep else mx.array(positions32)
        # A lockstep batch attends to exactly its positions, unless a sliding window hides some.
        masked = self.masked and (not lockstep or self.windowed)
        mask = decode_mask(mx.array(plan.valid()), self.mask_rank) if masked else None
        # Sliding-window layers read each row's window alone where it is shorter than the length.
        narrow = self.gather_window is not None and self.gather_window < plan.length
        if self.row_cache is not None:
            self.defer_dense(decode, plan)
            span = RowSpan(
                self.row_cache, decode.rows, positions=None if lockstep else offsets,
                rows_array=None if lockstep else mx.array(rows.astype(np.int32)), length=plan.length,
                compact=plan.compact, same_position=int(positions[0]) if lockstep else None, decode=True,
            )
            # (out of the row cache: its columns are positions)
            return ForwardBatch(write_slots=None, gather_index=None, offset=offsets, mask=mask, rows=span,
                                window_gather=self.window_gather(plan) if narrow else None), True
        write_slots = mx.array(plan.slot_ids, dtype=mx.int32)
        if self.device_table is None:
            # Only this path reads decode positions back from the host table.
            self.slot_table[decode.rows, decode.positions] = decode.slot_ids
            # Padding rows (past the host table) attend to the padding slot 0 only.
            index = np.zeros((len(rows), plan.length), dtype=self.slot_table.dtype)
            index[: len(decode.rows)] = self.slot_table[rows[: len(decode.rows)], : plan.length]
            batch = ForwardBatch(write_slots=write_slots, gather_index=mx.array(index), offset=offsets, mask=mask,
                                 lengths=mx.array(positions32 + 1) if self.attention is not None else None,
                                 attention=self.attention,
                                 window_gather=self.window_gather(plan, index) if narrow else None)
            return batch, True
        table_rows = mx.array(rows.astype(np.int32))
        assert self.tail is not None  # (the kernel's device table comes with the decode tail)
        # A batch that only advances every row by one chained token extends the tail and
        # writes nothing in place, as does one that also dropped rows (``DecodeTail.narrow``);
        # any other batch first moves the tail into the pool.
        in_place, event = False, "continued"
        if not self.tail.steps.continues(decode, plan.pad):
            kept = self.tail.steps.kept_rows(decode, plan.pad) if NARROW_TAIL else None
            event = "narrowed"
            if kept is None or not self.tail.narrow(kept, rows, decode, plan.pad):
                full = len(self.tail.steps) >= self.tail.capacity
                in_place = self.tail.flush(self.pool, self.device_table)
                event = "flushed (full)" if full else "flushed (batch changed)" if in_place else "started"
        self.tail.events[event] += 1
        self.tail.steps.add(decode, plan.pad, rows, positions, plan.slot_ids)
        batch = ForwardBatch(write_slots=write_slots, gather_index=None, offset=offsets, mask=mask,
                             lengths=mx.array(positions32 + 1), attention=self.attention, table=self.device_table,
                             table_rows=table_rows, tail=self.tail, tail_len=self.tail.old_length(),
                             launch=self.launch(len(rows), plan.length))
        return batch, in_place

    def window_gather(self, plan: DecodePlan, index: np.ndarray | None = None) -> WindowGather:
        """The narrowed K/V of sliding-window layers: each row's last ``gather_window`` positions,
        the positions mlx-lm's RotatingKVCache keeps, so those layers gather and attend to W
        positions, not the length. As pool slots out of ``index`` (B, plan.length) for the pool
        gather, or as positions (the row cache's columns) where ``index`` is None."""
        window = self.gather_window
        assert window is not None
        columns = np.maximum(plan.positions + 1 - window, 0)[:, None] + np.arange(window)
        valid = columns <= plan.positions[:, None]
        columns = np.minimum(columns, plan.length - 1)
        picked = columns if index is None else np.where(valid, np.take_along_axis(index, columns, axis=1), 0)
        return WindowGather(window, mx.array(picked.astype(np.int32)), decode_mask(mx.array(valid), self.mask_rank))

    def defer_dense(self, decode: DecodeBatch, plan: DecodePlan) -> None:
        """Record a row-cache decode step: its K/V stay in the row cache (decode reads nothing
        else) until the pool may be read."""
        if not self.pending.continues(decode, plan.pad):
            self.flush_pending()
        self.pending.add(decode, plan.pad, plan.rows, plan.positions, decode.slot_ids)

    def launch(self, rows: int, length: int) -> tuple[int, int]:
        """The paged kernel's (splits, warps) for ``rows`` padded rows attending to ``length`` positions."""
        shape = self.pool.shape
        return launch_shape(rows, shape.n_kv_heads, shape.n_heads // shape.n_kv_heads, shape.head_dim, length)

    def flush_pending(self) -> None:
        """Copy the row cache's deferred decode K/V into the pool, now: the next writes to the
        row cache must not find this copy's graph still holding it."""
        taken = self.pending.take()
        if taken is not None:
            assert self.row_cache is not None
            self.row_cache.flush(self.pool, *taken)
            mx.eval(self.pool.arrays())

    def flush(self) -> None:
        """Bring the pool up to date (before a prefill reads it)."""
        if self.tail is not None:
            assert self.device_table is not None
            self.tail.events["flushed (prefill)"] += self.tail.flush(self.pool, self.device_table)
        self.flush_pending()

    def warm_up(self, length_bucket: int) -> int:
        """Compile every variant of the decode kernel this pool's batches can use; how many."""
        if self.device_table is None:
            return 0
        assert self.attention is not None
        shape = self.pool.shape
        n_rep = shape.n_heads // shape.n_kv_heads
        variants = PagedAttention.variants(shape.n_kv_heads, n_rep, shape.head_dim, self.max_rows, self.max_context,
                                           row_bucket, length_bucket)
        self.attention.warm_up(self.pool.dtype, shape.n_kv_heads, n_rep, shape.head_dim, variants,
                               tail=self.tail is not None, sinks=self.sinks)
        kinds = {(s.mode, s.dims, s.traditional): s for s in self.rope or () if s is not None}  # each rotating kernel
        for spec in kinds.values():
            self.attention.warm_up(self.pool.dtype, shape.n_kv_heads, n_rep, shape.head_dim, variants, rope=spec)
        return len(variants) * (1 + len(kinds))

    def state_arrays(self) -> list[mx.array]:
        """Arrays a step updates in place besides the pools."""
        arrays = [self.device_table] if self.device_table is not None else []
        return arrays + (self.row_cache.arrays() if self.row_cache is not None else [])

    def reset(self) -> None:
        """After a failed step, the deferred decode K/V (the tail's, the row cache's) reach the pool
        where they evaluate: a request that finished before the failure was cached when its last
        step came back; the failed step's rows fail, so what reaches their slots is never read."""
        if self.tail is not None:
            assert self.device_table is not None
            self.tail.abandon(self.pool, self.device_table)
        if len(self.pending) and self.row_cache is not None:
            try:
                mx.eval(self.row_cache.arrays())
            except Exception:  # (the failure's own arrays): their requests were not cached
                self.pending.clear()
                return
            self.flush_pending()
        self.pending.clear()
