"""Runs scheduler steps on the model: prefill chunks and chained, batched decode."""

from __future__ import annotations

import time

import mlx.core as mx
import mlx.nn as nn
import msgspec
import numpy as np

from runtime.protocol.worker import (
    AUX_FRESH,
    DecodeBatch,
    PrefillChunk,
    Step,
)
from runtime.worker.launched_step import LaunchedStep
from runtime.worker.model.discovery import CacheLayout
from runtime.worker.model.output_head import OutputHead
from runtime.worker.model.padding_probe import pads_recurrent_exactly
from runtime.worker.paths.attention_paths import AttentionPaths
from runtime.worker.paths.cuda.compiled_paged import CompiledPagedDecode
from runtime.worker.paths.cuda.fused_step import fused_logits
from runtime.worker.paths.cuda.gated_delta_check import kernel_for
from runtime.worker.paths.cuda.released import release_finished
from runtime.worker.paths.decode_plan import DecodePlan, plan_decode
from runtime.worker.paths.pool_cache import ForwardBatch, PoolLayerCache
from runtime.worker.paths.prefill_groups import prefill_groups
from runtime.worker.paths.prefill_shapes import (
    continuation_length,
    padded_rows,
    prefill_length,
)
from runtime.worker.paths.rows.compiled_decode import CompiledDecode, row_step_compiled
from runtime.worker.paths.rows.parallel_attention import streams_on
from runtime.worker.pools.aux_pool import AuxPool
from runtime.worker.pools.aux_prefill import keep_prefill_states, prefill_caches
from runtime.worker.pools.kv_pool import KVPool
from runtime.worker.prompt_logprobs import prompt_logprobs, read_prompt_logprobs
from runtime.worker.sampler import RowSampler, StepDraws
from runtime.worker.token_chain import TokenChain

# A step with prefill chunks and decode rows as one forward on the kernel path (``fused_step``): on since
# session 22's A/B on an H200 (8B mixed at 10/s, TPOT p50 15.5 / 11.5 ms fused, 15.7 / 15.7 apart).
FUSE_PREFILL = True
# The compiled decode step's kernel rotates the queries and new keys (``kernel_rope``) where that matches
# MLX's rope bit for bit at start-up: two kernel launches fewer per layer on a host-bound one-row step.
KERNEL_ROPE = True
# ... for steps of at most this many prefill tokens: a fused forward also runs the last layer's attention
# and MLP over the prefill rows (the LM head takes the decode rows only, ``OutputHead``), which pays where
# a step's fixed host cost dominates (session 21: 38-47 ms for 1-512 prefill tokens, 13 for the decode).
FUSE_MAX_TOKENS = 512
BUILD_FUSED_EARLY = True  # a fused step's forward built by ``build``, while the step before runs (off: ``prepare``)


class Engine:
    """Owns the model, the KV and aux-state pools, and the attention paths (``AttentionPaths``).

    ``LENGTH_BUCKET``: on the pool paths decode attends to a multiple of this many positions
    and batch rows are padded to bucket sizes (see ``plan_decode``).

    Chaining (``TokenChain``): a decode row whose input token is -1 takes the token this engine
    sampled for that row in the previous decode batch, as a lazy array (never read back first).
    """

    LENGTH_BUCKET = 128
    COMPILED_LENGTH_BUCKET = 32  # finer: a compiled step's attention costs its whole bucket, and a new trace is cheap

    def __init__(
        self,
        model: nn.Module,
        layout: CacheLayout,
        pool: KVPool,
        max_rows: int,
        max_context: int,
        aux_pool: AuxPool | None = None,
        row_cache: bool | None = None,
        compile_decode: bool = True,
        attention_streams: int = 1,
        pad_shapes: bool | None = None,
    ) -> None:
        on_gpu = mx.default_device().type == mx.DeviceType.gpu
        self.cuda = on_gpu and mx.cuda.is_available()
        # Whether forwards are padded to recurring shapes (``worker.pad_shapes``; None: on a GPU, where a
        # step costs its launch overhead more than its arithmetic and a new shape kernel builds).
        self.padded_shapes = on_gpu if pad_shapes is None else pad_shapes
        self.model = model
        self.layout = layout
        self.pool = pool
        self.aux_pool = aux_pool
        self.max_context = max_context
        # Seconds each part of the construction took (the start-up line's breakdown: attention paths,
        # RoPE deferral, compiled decode steps; on a GPU their kernel builds and start-up checks).
        self.startup_seconds: dict[str, float] = {}
        started = time.perf_counter()
        self.paths = AttentionPaths(model, layout, pool, max_rows, max_context, row_cache, self.LENGTH_BUCKET)
        self.startup_seconds["attention paths"] = time.perf_counter() - started
        started = time.perf_counter()
        self.gated_delta = kernel_for(model, layout, on_gpu and aux_pool is not None and mx.cuda.is_available())
        if self.gated_delta.use_kernel or self.gated_delta.problem:
            self.startup_seconds["delta-net kernel"] = time.perf_counter() - started
        # The one place a model's forward is kept uncompiled: one that cannot be traced (it reads
        # arrays back mid-forward) gets no compiled decode, hence no fused prefill + decode step.
        compile_decode = compile_decode and layout.traceable
        self.compiled: CompiledDecode | None = None
        on_cpu = mx.default_device().type == mx.DeviceType.cpu
        if (compile_decode and row_step_compiled(on_cpu, self.padded_shapes, mx.cuda.is_available()) and self.paths.row_cache is not None
                and CompiledDecode.supports(layout)):
            self.compiled = CompiledDecode.with_exact_folding(model, layout, self.paths.row_cache,
                                                              self.COMPILED_LENGTH_BUCKET, max_context, aux_pool,
                                                              streams_on(on_cpu, attention_streams))
        self.compiled_paged: CompiledPagedDecode | None = None
        if compile_decode and self.paths.tail is not None and CompiledDecode.supports(layout):
            assert self.paths.attention is not None
            started = time.perf_counter()
            rope = self.paths.kernel_rope(model, layout) if KERNEL_ROPE else None
            self.startup_seconds["kernel RoPE"] = time.perf_counter() - started
            started = time.perf_counter()
            self.compiled_paged = CompiledPagedDecode(model, layout, pool, self.paths.attention, self.paths.tail, rope,
                                                      aux_pool)
            self.startup_seconds["compiled step"] = time.perf_counter() - started
        self.chain = TokenChain()  # chained decode: the previous batch's lazy tokens
        # Fusing needs the paged kernel's tail, every layer attention (no recurrent state), no
        # window or sinks (the fused prefill's attention has neither) and plain 4-D queries.
        self.fuse_prefill = (FUSE_PREFILL and self.compiled_paged is not None and layout.mask_rank == 4
                             and aux_pool is None and not layout.windowed and not layout.sinks)
        self.output_head = OutputHead(model)
        self.sampler = RowSampler(max_rows)
        # Share of padding a batched prefill may carry (0: none, and prefill shapes unpadded).
        self.max_padding = 0.25 if self.padded_shapes else 0.0
        # A hybrid's prompts are padded too where its recurrent layers honour the real lengths
        # (``padding_probe``); else each prompt length is a shape of its own.
        self.pads_recurrent = self.padded_shapes and aux_pool is not None and pads_recurrent_exactly(model, layout)
        # A hybrid's chunks of different starts share a forward on the pool paths (``mixed_prefill``).
        self.mixed_starts = aux_pool is not None and self.paths.row_cache is None and not (layout.windowed or layout.shares_kv)
        self.prefill_shapes: set[tuple[int, int, int]] = set()  # (rows, queries, keys) of every prefill forward run

    def _caches(self, batch: ForwardBatch, aux: list | None = None) -> list:
        """One cache object per entry: pool views for attention, ArraysCache for auxiliary state
        (nested as the model's own cache list is: a CacheList per layer for Falcon-H1)."""
        caches: list = []
        aux_iter = iter(aux or [])
        for entry, kv_i in enumerate(self.layout.kv_index):
            caches.append(PoolLayerCache(self.pool, kv_i, batch, self.layout.window(entry)) if kv_i >= 0
                          else next(aux_iter))
        return self.layout.nest(caches)

    def _prefill(self, chunk: PrefillChunk) -> None:
        """A full-prefix hit: the table row (and the prefix's saved state), nothing to run."""
        self.paths.admit_chunk(chunk)
        if self.aux_pool is not None and chunk.aux_source >= 0:
            self.aux_pool.copy(chunk.aux_source, chunk.aux_slot)
        elif self.aux_pool is not None and chunk.aux_source == AUX_FRESH:
            self.aux_pool.zero(chunk.aux_slot)

    def apply_masks(self, launched: LaunchedStep, masks: list[bytes]) -> None:
        """Sample a decode whose deferred rows' masks just came (``Masks``), and queue it."""
        decode, logits = launched.awaiting, launched.logits
        assert decode is not None and logits is not None and len(masks) == len(decode.deferred_rows)
        full = msgspec.structs.replace(decode, mask_rows=decode.mask_rows + decode.deferred_rows,
                                       masks=decode.masks + masks, deferred_rows=[])
        draws = self._sampled(decode, self.sampler.sample(logits, full))
        launched.draws, launched.tokens, launched.awaiting, launched.logits = draws, draws.tokens, None, None
        mx.async_eval(*draws.arrays())

    def _decode_logits(self, decode: DecodeBatch) -> tuple[mx.array, bool]:
        """A decode batch's logits (rows padded to the batch's bucket may follow), lazy, and
        whether building them updated pools in place."""
        if not self.gated_delta.use_kernel:  # (no scope to enter on the hot path)
            return self._decode_forward(decode)
        with self.gated_delta.scope():  # a delta-net layer's step as one kernel (CUDA), traced or not
            return self._decode_forward(decode)

    def _decode_forward(self, decode: DecodeBatch) -> tuple[mx.array, bool]:
        plan = self._plan(decode)
        # A hybrid's states: the last step's, kept batch-ordered while the batch is unchanged or
        # only lost rows (else the pool's, the last batch's written back first: a write in place).
        states, flushes = None, False
        if self.aux_pool is not None:
            states, flushes = self.aux_pool.batch_states(plan.aux_slots)
        if self.compiled is not None:
            self.paths.defer_dense(decode, plan)
            inputs = self.chain.inputs(decode)
            padded = 0 if plan.compact else self.compiled.padded_rows(list(decode.rows))
            if padded:  # (never a hybrid's batch)
                return self.compiled.forward_padded(inputs, list(decode.rows), list(decode.positions), plan.length,
                                                    padded), True
            logits, states = self.compiled.forward(inputs, mx.array(plan.rows.astype(np.int32)), plan.positions,
                                                   plan.compact, plan.length, states)
            in_place = True
        else:
            inputs, batch, in_place = self._pool_decode(decode, plan)
            # Every row count decodes compiled: a new trace costs about 35 ms once its kernels exist
            # (scripts/decode_trace_cost.py), while eager batches of many rows ran a quarter slower.
            if self.compiled_paged is not None:
                logits, states = self.compiled_paged.forward(inputs, batch, states)
            else:
                aux = AuxPool.wrap(states) if states is not None else None
                logits = self.model(inputs[:, None], cache=self._caches(batch, aux))[:, -1, :]
                states = [c.cache for c in aux] if aux is not None else None
        if states is not None:
            self.aux_pool.keep(plan.aux_slots, states)
        # Padding rows stay: the sampler drops them, after drawing at the bucket's shape.
        return logits, in_place or flushes

    def _plan(self, decode: DecodeBatch) -> DecodePlan:
        return plan_decode(decode, dense=self.paths.dense, length_bucket=self.LENGTH_BUCKET,
                           max_context=self.max_context, padding_row=len(self.paths.slot_table))

    def _pool_decode(self, decode: DecodeBatch, plan: DecodePlan) -> tuple[mx.array, ForwardBatch, bool]:
        """A pool-path decode's input tokens (padding rows included), its forward batch, and
        whether building that updated pools in place."""
        inputs = self.chain.inputs(decode)
        batch, in_place = self.paths.decode_batch(decode, plan)
        if plan.pad:
            inputs = mx.concatenate([inputs, mx.zeros((plan.pad,), dtype=inputs.dtype)])
        return inputs, batch, in_place

    def _sampled(self, decode: DecodeBatch, draws: StepDraws) -> StepDraws:
        self.chain.keep(decode.rows, draws.tokens)
        return draws

    def build(self, step: Step) -> LaunchedStep:
        """Build a decode-only or fused step's lazy graph (``fuses``: a fused one's building overlaps
        the previous step's run; it is submitted after that step's read-back, when its pool writes
        run in place), chained on the previous step's lazy tokens. Other prefill steps are only
        recorded here: ``prepare`` runs them once the previous step has been read back."""
        if step.samplings:
            self.sampler.configure(step.samplings)
        launched = LaunchedStep(step.step_id, step=step, first_tokens=bool(step.prefills))
        if not step.prefills:
            self._build_decode(launched)
        elif BUILD_FUSED_EARLY and self.fuses(step):
            self.paths.flush()
            self._build_decode(launched, self._fused_logits(self._groups(step.prefills), step.decode))
        return launched

    def fuses(self, step: Step) -> bool:
        """Whether a step's prefill chunks run in its decode forward (``fused_step``)."""
        return (self.fuse_prefill and step.decode is not None and bool(step.decode.rows)
                and sum(len(c.token_ids) for c in step.prefills) <= FUSE_MAX_TOKENS
                and not any(c.logprob_targets for c in step.prefills))  # fused: no prefill logits

    def _groups(self, chunks: list[PrefillChunk]) -> list[list[PrefillChunk]]:
        return prefill_groups(chunks, batchable=True, max_padding=self.max_padding, recurrent=self.aux_pool is not None,
                              pads_recurrent=self.pads_recurrent, mixed_starts=self.mixed_starts)

    def prepare(self, launched: LaunchedStep) -> None:
        """Run a step's prefill chunks, then build its decode (after the previous read-back). Each
        chunk is evaluated (and ``settle``d) before the next is built: a later chunk's pool write would
        otherwise find the pools held by the earlier chunk's graph and copy them whole. Not the last
        where the decode only appends to the tail (emptied by the flush here): nothing after it writes
        the pools, so the host encodes the decode while the device runs the prefill."""
        if launched.step is None or not launched.step.prefills:
            return
        self.paths.flush()
        groups = self._groups(launched.step.prefills)
        if self.fuses(launched.step):  # (built here only where ``BUILD_FUSED_EARLY`` is off)
            return self._build_decode(launched, self._fused_logits(groups, launched.step.decode))
        appends_only = self.paths.tail is not None
        for i, group in enumerate(groups):
            if group[0].token_ids:
                launched.prompt_arrays += self._prefill_batch(group)
            else:
                self._prefill(group[0])
            if i + 1 < len(groups) or not appends_only:
                mx.eval(self._written())
                self.settle()
        self._build_decode(launched)

    def settle(self) -> None:
        """On CUDA, let finished work release its buffers: the writes after it stay in place (``released``)."""
        if self.cuda:
            release_finished()

    def _prefill_inputs(self, group: list[PrefillChunk]) -> tuple[ForwardBatch, list[list[int]]]:
        """Admit chunks (of one start, or a hybrid's round) and address them as one padded batch: the
        batch, and its (rows, length) tokens (shorter chunks padded at the end, padding rows after)."""
        start = max(c.start for c in group)
        n = max(len(c.token_ids) for c in group)
        rows = len(group)
        padded = self.max_padding > 0 and (self.aux_pool is None or self.pads_recurrent)
        if padded:
            # Padded even alone (a new shape costs kernel builds on a GPU); never below a row's length.
            n = max(min((continuation_length if start else prefill_length)(n), self.max_context - start), n)
            # (A row span is per real row.) A hybrid's padding rows run from empty states, length 0.
            rows = padded_rows(rows) if self.paths.row_cache is None else rows
        for chunk in group:
            self.paths.admit_chunk(chunk)
        batch = self.paths.prefill_batch(group, n, rows, pad_keys=padded)
        keys = batch.gather_index.shape[1] if batch.gather_index is not None else n
        self.prefill_shapes.add((rows, n, keys))
        tokens = [c.token_ids + [0] * (n - len(c.token_ids)) for c in group] + [[0] * n] * (rows - len(group))
        return batch, tokens

    def _fused_logits(self, groups: list[list[PrefillChunk]], decode: DecodeBatch) -> tuple[mx.array, bool]:
        """The decode rows' logits from one forward that also runs every prefill group
        (``fused_step``); lazy, and whether it updated pools in place (it does)."""
        prefills = []  # admitted first, as the separate forwards are: the decode reads their table rows
        for group in groups:
            if group[0].token_ids:
                prefills.append((*self._prefill_inputs(group), group[0].start))
            else:
                self._prefill(group[0])
        inputs, batch, _ = self._pool_decode(decode, self._plan(decode))
        return fused_logits(self.model, self.output_head, self.layout, self.pool, batch, inputs, prefills), True

    def _prefill_batch(self, group: list[PrefillChunk]) -> list[tuple]:
        """Run chunks of one start as one forward (shorter ones padded at the end); the prompt
        logprobs of the chunks that asked, lazy (``prompt_logprobs``)."""
        batch, tokens = self._prefill_inputs(group)
        aux = prefill_caches(self.aux_pool, group, len(tokens[0]), len(tokens)) if self.aux_pool is not None else None
        with self.gated_delta.scope():  # a delta-net layer's prompt as one kernel (CUDA)
            logits = self.model(mx.array(tokens, dtype=mx.int32), cache=self._caches(batch, aux))
        asked = [(c, *prompt_logprobs(logits[i, : len(c.token_ids)], c.logprob_targets, c.top_logprobs))
                 for i, c in enumerate(group) if c.logprob_targets]
        if aux is not None:
            keep_prefill_states(self.aux_pool, aux, group)
        return asked

    def _build_decode(self, launched: LaunchedStep, computed: tuple[mx.array, bool] | None = None) -> None:
        """The step's sampling from its decode logits (``computed``: already built, with
        whether that updated pools in place), and the marker of its pool writes."""
        step = launched.step
        assert step is not None
        launched.tokens, in_place = None, True
        if step.decode is not None and step.decode.rows:
            logits, in_place = computed if computed is not None else self._decode_logits(step.decode)
            if step.decode.deferred_rows:  # sampled by ``apply_masks`` once their masks come
                launched.awaiting, launched.logits = step.decode, logits
            else:
                launched.draws = self._sampled(step.decode, self.sampler.sample(logits, step.decode))
                launched.tokens = launched.draws.tokens
        launched.in_place = bool(step.prefills) or in_place
        if launched.tokens is not None and not step.prefills:
            # Decode attention reads what the step writes (pool, row cache, tail), so the
            # tokens already depend on those writes; only the aux-state write-backs need a marker.
            launched.written = self._written(self.aux_pool.arrays()) if self.aux_pool is not None else None
        else:
            launched.written = self._written()
        launched.step = None

    def _written(self, arrays: list[mx.array] | None = None) -> mx.array:
        """One element of every pool array: evaluating it runs every pending pool write,
        and only this small graph (not the pools themselves) holds the pools meanwhile."""
        arrays = self.state_arrays() if arrays is None else arrays
        # One element by index on every axis: a view. (``a[0].reshape(-1)`` copied the whole
        # first row of each array: 38 ms per prefill for a CPU row cache of 8192 positions.)
        return mx.stack([a[(0,) * a.ndim].astype(mx.float32) for a in arrays]).sum()

    def submit(self, built: LaunchedStep) -> None:
        """Queue a built step on the device without waiting for it."""
        self.prepare(built)
        targets = [t for t in (built.written, built.tokens, built.logits) if t is not None]
        if built.draws is not None:
            targets += built.draws.arrays()[1:]
        targets += [a for entry in built.prompt_arrays for a in entry[1:]]
        mx.async_eval(*targets)

    def launch(self, step: Step) -> LaunchedStep:
        """Build and submit (for callers that read each step back before building the next)."""
        built = self.build(step)
        self.submit(built)
        return built

    def finalize(self, launched: LaunchedStep) -> list[int]:
        """Read a launched step's sampled tokens back as plain ints (and its prompt logprobs)."""
        if launched.prompt_arrays:
            launched.prompt_logprobs = read_prompt_logprobs(launched.prompt_arrays)
            launched.prompt_arrays = []
        if launched.tokens is None:
            mx.eval(launched.written)
            return []
        draws = launched.draws
        extra = draws.arrays()[1:] if draws is not None else []
        mx.eval([t for t in (launched.tokens, launched.written) if t is not None] + extra)
        if draws is not None and draws.token_logprobs is not None:
            launched.logprobs = draws.read_logprobs()
        launched.draws = None
        return launched.tokens.tolist()

    def state_arrays(self) -> list[mx.array]:
        """Every array a step updates in place (KV pool, aux pool, the paths' tables and caches)."""
        arrays = self.pool.arrays() + (self.aux_pool.arrays() if self.aux_pool is not None else [])
        return arrays + self.paths.state_arrays()

    @property
    def shapes_built(self) -> tuple[int, int]:
        """(prefill shapes run, compiled decode traces made) so far: each new one costs a
        trace, and on a GPU kernel builds."""
        traces = sum(c.traces.built for c in (self.compiled, self.compiled_paged) if c is not None)
        return len(self.prefill_shapes), traces

    def reset_chain(self) -> None:
        self.chain.reset()
        self.paths.reset()
        if self.aux_pool is not None:
            self.aux_pool.drop()  # (what evaluates reaches the pool: finished requests' states were cached)
