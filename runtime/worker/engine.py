"""Runs scheduler steps on the model: prefill chunks and chained, batched decode."""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np

from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH, DecodeBatch, PrefillChunk, Step
from runtime.worker import attention_patch
from runtime.worker.aux_pool import AuxPool
from runtime.worker.decode_plan import plan_decode
from runtime.worker.decode_tail import DecodeTail
from runtime.worker.discovery import CacheLayout
from runtime.worker.kv_pool import KVPool
from runtime.worker.paged_attention import PagedAttention
from runtime.worker.prefill_groups import prefill_groups
from runtime.worker.pool_cache import ForwardBatch, PoolLayerCache
from runtime.worker.row_cache import MAX_BYTES, RowCache, RowSpan


@dataclass
class LaunchedStep:
    """A step whose work is queued on the device but not read back yet."""

    step_id: int
    tokens: mx.array | None = None
    written: mx.array | None = None
    step: Step | None = None
    in_place: bool = True  # updates the pools in place: submit only after the previous read-back


class Engine:
    """Owns the model, the KV pool and the host-side request→slot table.

    Decode attention takes one of three paths: the CUDA paged kernel, with new K/V in a
    ``DecodeTail`` (GPU); a dense ``RowCache`` (where the kernel does not apply and the copy
    fits); or K/V gathered from the pool into a masked batch (otherwise).

    ``LENGTH_BUCKET``: on the pool paths decode attends to a multiple of this many positions
    and batch rows are padded to bucket sizes (see ``plan_decode``).

    Chaining: a decode row whose input token is -1 takes the token this engine sampled
    for that row in the previous decode batch, as a lazy array (never read back first).
    """

    LENGTH_BUCKET = 128
    PREFILL_PAD = 16  # a padded prefill batch's length is rounded up to this, so shapes recur
    TAIL_STEPS = 16  # decode steps a DecodeTail holds before it is flushed into the pool
    PENDING_STEPS = 64  # row-cache decode steps not yet copied into the pool, at most

    def __init__(
        self,
        model: nn.Module,
        layout: CacheLayout,
        pool: KVPool,
        max_rows: int,
        max_context: int,
        aux_pool: AuxPool | None = None,
        row_cache: bool | None = None,
    ) -> None:
        self.model = model
        self.layout = layout
        self.pool = pool
        self.aux_pool = aux_pool
        self.max_context = max_context
        self.slot_table = np.zeros((max_rows, max_context), dtype=np.int32)
        self._prev_tokens: mx.array | None = None
        self._prev_rows: list[int] = []
        self._flushed = False
        # Row-cache decode writes not yet copied into the pool: (rows, positions, slots) per step.
        self._pending: list[tuple[np.ndarray, np.ndarray, list[int]]] = []
        self._pending_rows: list[int] = []
        # Share of padding a batched prefill may carry: on a GPU, where a step costs its launch
        # overhead more than its arithmetic, batching pays for some; on the CPU it does not.
        self.max_padding = 0.25 if mx.default_device().type == mx.DeviceType.gpu else 0.0
        # Decode attention reads the pool through the slot table when mlx-lm's attention
        # call can be routed to it; otherwise K/V are gathered into a masked batch.
        paged = layout.kv_shape is not None and attention_patch.install(model, layout.attn_attr)
        self.attention = PagedAttention(PagedAttention.kernel_available()) if paged else None
        kernel = self.attention is not None and self.attention.supports(pool.shape.head_dim)
        # ``row_cache``: None picks it where the paged kernel is unavailable and it fits.
        want_rows = not kernel if row_cache is None else row_cache
        self.row_cache = self._make_row_cache(layout, max_rows, max_context, force=bool(row_cache)) if want_rows else None
        if self.row_cache is not None:
            self.attention, kernel = None, False  # decode attends to the row cache with mlx-lm's own call
        self._decode_mask = not kernel
        # The paged kernel reads slots from a device copy of the table (one extra all-padding
        # row for padding batch rows), so a decode step uploads O(batch) ints, not O(batch * length);
        # its decode steps keep their new K/V in a tail instead of the pool (see DecodeTail).
        self.device_table = mx.zeros((max_rows + 1, max_context), dtype=mx.int32) if kernel else None
        n_attn = len(layout.attention_layers)
        self.tail = DecodeTail(n_attn, self.TAIL_STEPS) if kernel and aux_pool is None else None

    @staticmethod
    def _make_row_cache(layout: CacheLayout, max_rows: int, max_context: int, force: bool) -> RowCache | None:
        """A row cache of at most ``MAX_BYTES`` (any size when forced)."""
        if layout.kv_shape is None:
            return None
        size = RowCache.nbytes_for(len(layout.attention_layers), max_rows, max_context, layout.kv_shape, layout.kv_dtype)
        if size > MAX_BYTES and not force:
            return None
        return RowCache(len(layout.attention_layers), max_rows, max_context, layout.kv_shape, layout.kv_dtype)

    def _set_table(self, row: int, start: int, slots: list[int]) -> None:
        """Record the slots of positions ``start..`` of ``row`` (host table, and the device copy)."""
        self.slot_table[row, start : start + len(slots)] = slots
        if self.device_table is not None:
            self.device_table[row, start : start + len(slots)] = mx.array(slots, dtype=mx.int32)

    def _fill_prefix(self, chunk: PrefillChunk) -> None:
        if self.row_cache is not None and chunk.prefix_slots:
            self.row_cache.fill_prefix(self.pool, chunk.row, mx.array(chunk.prefix_slots, dtype=mx.int32))

    def _caches(self, batch: ForwardBatch, aux: list | None = None) -> list:
        """One cache object per entry: pool views for attention, ArraysCache for auxiliary state."""
        caches: list = []
        aux_iter = iter(aux or [])
        for kv_i in self.layout.kv_index:
            caches.append(PoolLayerCache(self.pool, kv_i, batch) if kv_i >= 0 else next(aux_iter))
        return caches

    def _aux_caches(self, source: mx.array | None) -> list:
        """Fresh (source None) or pool-loaded ArraysCache objects for every auxiliary entry."""
        from mlx_lm.models.cache import ArraysCache

        assert self.aux_pool is not None
        caches = []
        for k in range(len(self.layout.aux_layers)):
            cache = ArraysCache(len(self.aux_pool.states[k]))
            if source is not None:
                cache.cache = self.aux_pool.read(k, source)
            caches.append(cache)
        return caches

    def _store_aux(self, caches: list, slots: list[int]) -> None:
        assert self.aux_pool is not None
        index = mx.array(slots, dtype=mx.int32)
        for k, cache in enumerate(caches):
            self.aux_pool.write(k, index, cache.cache)

    def _prefill(self, chunk: PrefillChunk) -> None:
        row, start, n = chunk.row, chunk.start, len(chunk.token_ids)
        if chunk.prefix_slots:
            self._set_table(row, 0, chunk.prefix_slots)
        hybrid = self.aux_pool is not None
        self._fill_prefix(chunk)
        if n == 0:
            # A full-prefix hit only sets the table row (and restores the prefix's state).
            if hybrid and chunk.aux_source >= 0:
                self.aux_pool.copy(chunk.aux_source, chunk.aux_slot)
            elif hybrid and chunk.aux_source == AUX_FRESH:
                self.aux_pool.zero(chunk.aux_slot)
            return
        self._set_table(row, start, chunk.slot_ids)
        # Past position 0 the chunk attends to its prefix: in the row cache, else gathered.
        gather = None
        if start and self.row_cache is None:
            gather = mx.array(self.slot_table[row : row + 1, : start + n])
        batch = ForwardBatch(
            write_slots=mx.array(chunk.slot_ids, dtype=mx.int32),
            gather_index=gather,
            offset=start,
            mask=None,
            rows=RowSpan(self.row_cache, [row], start) if self.row_cache is not None else None,
        )
        aux = None
        if hybrid:
            source = None if chunk.aux_source == AUX_FRESH else (
                chunk.aux_slot if chunk.aux_source == AUX_CONTINUE else chunk.aux_source
            )
            aux = self._aux_caches(None if source is None else mx.array([source], dtype=mx.int32))
        self.model(mx.array(chunk.token_ids, dtype=mx.int32)[None], cache=self._caches(batch, aux))
        if aux is not None:
            targets = [chunk.aux_slot] + ([chunk.aux_snapshot] if chunk.aux_snapshot >= 0 else [])
            for slot in targets:
                self._store_aux(aux, [slot])

    def _decode_inputs(self, decode: DecodeBatch) -> mx.array:
        rows, token_ids = decode.rows, decode.token_ids
        if self._prev_tokens is not None and rows == self._prev_rows and max(token_ids) < 0:
            return self._prev_tokens  # the common case: the same rows, every one chained
        explicit = mx.array([max(t, 0) for t in token_ids], dtype=mx.int32)
        chained = [t < 0 for t in token_ids]
        if not any(chained):
            return explicit
        assert self._prev_tokens is not None, "chained decode without a previous decode step"
        prev_index = {r: i for i, r in enumerate(self._prev_rows)}
        prev_idx = mx.array([prev_index[r] if t < 0 else 0 for r, t in zip(rows, token_ids)], dtype=mx.int32)
        return mx.where(mx.array(chained), self._prev_tokens[prev_idx], explicit)

    def _decode(self, decode: DecodeBatch) -> mx.array:
        rc, dt = self.row_cache, self.device_table
        self.slot_table[decode.rows, decode.positions] = decode.slot_ids
        plan = plan_decode(decode, dense=rc is not None, length_bucket=self.LENGTH_BUCKET,
                           max_context=self.max_context, padding_row=len(self.slot_table))
        bsz, pad, length, lockstep = len(decode.rows), plan.pad, plan.length, plan.lockstep
        rows, positions, slot_ids, aux_slots = plan.rows, plan.positions, plan.slot_ids, plan.aux_slots
        gather_np = None
        if rc is None and dt is None:
            # Padding rows (past the host table) attend to the padding slot 0 only.
            gather_np = np.zeros((len(rows), length), dtype=self.slot_table.dtype)
            gather_np[:bsz] = self.slot_table[rows[:bsz], :length]
        mask = mx.array(plan.valid())[:, None, None, :] if self._decode_mask and not lockstep else None
        positions32 = positions.astype(np.int32)
        offsets: int | mx.array = int(positions[0]) if lockstep else mx.array(positions32)
        span = None
        if rc is not None:
            # Decode K/V stay in the row cache (decode reads nothing else); the pool gets them
            # before anything reads it: at the first step that changes the batch or prefills.
            if self._pending and (max(decode.token_ids) >= 0 or decode.rows != self._pending_rows
                                  or len(self._pending) >= self.PENDING_STEPS):
                self._flush_pending()
            self._pending.append((rows, positions, decode.slot_ids))
            self._pending_rows = decode.rows
            span = RowSpan(rc, decode.rows, positions=None if lockstep else offsets,
                           rows_array=None if lockstep else mx.array(rows.astype(np.int32)),
                           length=length, compact=plan.compact, same_position=int(positions[0]) if lockstep else None,
                           decode=True)
        write_slots = mx.array(slot_ids, dtype=mx.int32) if rc is None else None
        table_rows = None
        self._flushed = False
        if dt is not None:
            table_rows = mx.array(rows.astype(np.int32))
            if self.tail is None:
                dt[table_rows, offsets] = write_slots
            else:
                # A batch that only advances every row by one chained token extends the tail;
                # any other batch first moves the tail into the pool.
                batch_key = (tuple(decode.rows), pad)
                if max(decode.token_ids) >= 0 or not self.tail.continues(batch_key):
                    self._flushed = self._flush_tail()
                self.tail.start_step(batch_key, table_rows, offsets, write_slots)
        batch = ForwardBatch(
            write_slots=write_slots,
            gather_index=mx.array(gather_np) if gather_np is not None else None,
            table=dt,
            table_rows=table_rows,
            offset=offsets,
            mask=mask,
            lengths=mx.array(positions32 + 1) if self.attention is not None else None,
            attention=self.attention,
            rows=span,
            tail=self.tail,
            write_pool=rc is None,
        )
        inputs = self._decode_inputs(decode)
        if pad:
            inputs = mx.concatenate([inputs, mx.zeros((pad,), dtype=inputs.dtype)])
        aux = None
        if self.aux_pool is not None:
            aux = self._aux_caches(mx.array(aux_slots, dtype=mx.int32))
        logits = self.model(inputs[:, None], cache=self._caches(batch, aux))[:, -1, :]
        if aux is not None:
            self._store_aux(aux, aux_slots)
        if pad:
            logits = logits[:bsz]
        logprobs = logits - mx.logsumexp(logits, axis=-1, keepdims=True)
        tokens = mx.argmax(logprobs, axis=-1).astype(mx.int32)
        temps = decode.temperatures
        if max(temps) > 0:
            inv = mx.array([1.0 / t if t > 0 else 1.0 for t in temps], dtype=logprobs.dtype)
            sampled = mx.random.categorical(logprobs * inv[:, None]).astype(mx.int32)
            tokens = mx.where(mx.array([t > 0 for t in temps]), sampled, tokens)
        self._prev_tokens = tokens
        self._prev_rows = decode.rows
        return tokens

    def build(self, step: Step) -> LaunchedStep:
        """Build a decode-only step's lazy graph, chained on the previous step's lazy tokens.

        A step with prefill chunks is only recorded here: ``prepare`` runs it once the
        previous step has been read back.
        """
        launched = LaunchedStep(step.step_id, step=step)
        if not step.prefills:
            self._build_decode(launched)
        return launched

    def prepare(self, launched: LaunchedStep) -> None:
        """Run a step's prefill chunks, then build its decode (after the previous read-back).

        Each chunk is evaluated before the next is built: a later chunk's pool write would
        otherwise find the pools held by the earlier chunk's graph and copy them whole.
        """
        if launched.step is None or not launched.step.prefills:
            return
        self._flush_tail()
        self._flush_pending()
        for group in self._prefill_groups(launched.step.prefills):
            if len(group) == 1:
                self._prefill(group[0])
            else:
                self._prefill_batch(group)
            mx.eval(self._written())
        self._build_decode(launched)

    def _prefill_groups(self, chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
        return prefill_groups(chunks, batchable=True, max_padding=self.max_padding, recurrent=self.aux_pool is not None)

    def _prefill_batch(self, group: list[PrefillChunk]) -> None:
        start = group[0].start
        longest = max(len(c.token_ids) for c in group)
        n = longest
        if self.max_padding > 0 and self.aux_pool is None:
            n = min(-(-longest // self.PREFILL_PAD) * self.PREFILL_PAD, self.max_context - start)
        for chunk in group:
            if chunk.prefix_slots:
                self._set_table(chunk.row, 0, chunk.prefix_slots)
            self._set_table(chunk.row, start, chunk.slot_ids)
            self._fill_prefix(chunk)
        rows = [c.row for c in group]
        # Padding positions write their K/V to the padding slot 0; in the row cache they land
        # past the row's length, which decode overwrites before it ever attends there.
        pads = [n - len(c.token_ids) for c in group]
        tokens = [c.token_ids + [0] * pad for c, pad in zip(group, pads)]
        gather = None
        if start and self.row_cache is None:
            gather = self.slot_table[rows, : start + n].copy()
            for i, c in enumerate(group):
                gather[i, start + len(c.token_ids) :] = 0
            gather = mx.array(gather)
        batch = ForwardBatch(
            write_slots=mx.array([s for c, pad in zip(group, pads) for s in c.slot_ids + [0] * pad], dtype=mx.int32),
            gather_index=gather,
            offset=start,
            mask=None,
            rows=RowSpan(self.row_cache, rows, start) if self.row_cache is not None else None,
        )
        aux = None
        if self.aux_pool is not None:
            # Every row starts from an empty state, or every row from a saved slot (see prefill_groups).
            sources = None
            if group[0].aux_source != AUX_FRESH:
                sources = [c.aux_slot if c.aux_source == AUX_CONTINUE else c.aux_source for c in group]
            aux = self._aux_caches(None if sources is None else mx.array(sources, dtype=mx.int32))
        self.model(mx.array(tokens, dtype=mx.int32), cache=self._caches(batch, aux))
        if aux is not None:
            self._store_aux(aux, [c.aux_slot for c in group])
            snaps = [(i, c.aux_snapshot) for i, c in enumerate(group) if c.aux_snapshot >= 0]
            if snaps:
                index = mx.array([i for i, _ in snaps], dtype=mx.int32)
                slots = mx.array([s for _, s in snaps], dtype=mx.int32)
                for k, cache in enumerate(aux):
                    self.aux_pool.write(k, slots, [state[index] for state in cache.cache])

    def _build_decode(self, launched: LaunchedStep) -> None:
        step = launched.step
        assert step is not None
        self._flushed = True
        launched.tokens = self._decode(step.decode) if step.decode is not None and step.decode.rows else None
        # With the tail, a decode-only step that did not flush it writes nothing in place.
        launched.in_place = bool(step.prefills) or self.tail is None or self._flushed
        if launched.tokens is not None and not step.prefills:
            # Decode reads every KV pool back after writing it, so the tokens already depend
            # on those writes; only the aux-state write-backs need a marker.
            launched.written = self._written(self.aux_pool.arrays()) if self.aux_pool is not None else None
        else:
            launched.written = self._written()
        launched.step = None

    def _written(self, arrays: list[mx.array] | None = None) -> mx.array:
        """One element of every pool array: evaluating it runs every pending pool write,
        and only this small graph (not the pools themselves) holds the pools meanwhile."""
        arrays = self._state_arrays() if arrays is None else arrays
        return mx.stack([a[0].reshape(-1)[0].astype(mx.float32) for a in arrays]).sum()

    def submit(self, built: LaunchedStep) -> None:
        """Queue a built step on the device without waiting for it."""
        self.prepare(built)
        targets = [t for t in (built.written, built.tokens) if t is not None]
        mx.async_eval(*targets)

    def launch(self, step: Step) -> LaunchedStep:
        """Build and submit (for callers that read each step back before building the next)."""
        built = self.build(step)
        self.submit(built)
        return built

    def finalize(self, launched: LaunchedStep) -> list[int]:
        """Read a launched step's sampled tokens back as plain ints."""
        if launched.tokens is None:
            mx.eval(launched.written)
            return []
        mx.eval([t for t in (launched.tokens, launched.written) if t is not None])
        return launched.tokens.tolist()

    @staticmethod
    def overlap_submit(on_gpu: bool, pool_bytes: int, limit_mb: int) -> bool:
        """Whether to submit a step before reading the previous one back (see WorkerConfig)."""
        return on_gpu and pool_bytes <= limit_mb * 2**20

    def _state_arrays(self) -> list[mx.array]:
        arrays = self.pool.arrays() + (self.aux_pool.arrays() if self.aux_pool is not None else [])
        arrays += [self.device_table] if self.device_table is not None else []
        return arrays + (self.row_cache.arrays() if self.row_cache is not None else [])

    @property
    def state_bytes(self) -> int:
        """Bytes of every array a step updates in place (KV pool, aux pool, row cache)."""
        return sum(a.nbytes for a in self._state_arrays())

    def _flush_pending(self) -> None:
        """Copy pending row-cache decode K/V into the pool, now: the next writes to the row
        cache must not find this copy's graph still holding it."""
        if not self._pending:
            return
        assert self.row_cache is not None
        rows = mx.array(np.concatenate([r for r, _, _ in self._pending]).astype(np.int32))
        positions = mx.array(np.concatenate([p for _, p, _ in self._pending]).astype(np.int32))
        slots = mx.array([s for _, _, step_slots in self._pending for s in step_slots], dtype=mx.int32)
        self.row_cache.flush(self.pool, rows, positions, slots)
        mx.eval(self.pool.arrays())
        self._pending, self._pending_rows = [], []

    def _flush_tail(self) -> bool:
        return self.tail is not None and self.tail.flush(self.pool, self.device_table)

    def reset_chain(self) -> None:
        self._prev_tokens = None
        self._prev_rows = []
        if self.tail is not None:
            self.tail.clear()
        self._pending, self._pending_rows = [], []
