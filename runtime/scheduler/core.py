"""Scheduling policy: admission, continuous batching, chunked prefill, prefix reuse.

Pure Python over ints (no mlx, no sockets). The server asks ``next_step()`` for the
next worker step and feeds results back through ``on_step_done``; up to
``pipeline_depth`` steps are in flight, so a step is planned before the previous ones'
tokens are known. A request that finishes stops at once; its tokens from steps already in
flight are dropped, its slots are released (and cached) when those steps return, and only
then is it reported complete (``pop_completed``).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from runtime.protocol.worker import Masks, PrefillChunk, PromptLogprobs, Step
from runtime.scheduler.admission import Limits, validate_request
from runtime.scheduler.aux_state import AuxTracker
from runtime.scheduler.decode_batch import build_decode, deferred_masks
from runtime.scheduler.grammar import MaskClock
from runtime.scheduler.invariants import check_scheduler
from runtime.scheduler.prefill_chunks import prompt_chunk, table_chunk
from runtime.scheduler.radix import InsertResult, RadixCache
from runtime.scheduler.request import Request, row_sampling
from runtime.scheduler.rows import RowAllocator
from runtime.scheduler.slots import SlotAllocator
from runtime.scheduler.step_results import (
    PlannedStep,
    StepOutput,
    take_prompt_logprobs,
    take_token,
)
from runtime.scheduler.waiting import WaitingQueue


class Scheduler:
    """Waiting queue, running set, KV slots, rows and the radix cache."""

    # Steps in flight. With three, the worker always finds the next step waiting when it
    # blocks to read one back, so the device has one step running and one queued.
    pipeline_depth = 3

    def __init__(self, limits: Limits, eos_ids: frozenset[int], debug_invariants: bool = False) -> None:
        self.limits = limits
        self.eos_ids = eos_ids
        self.debug_invariants = debug_invariants
        self.slots = SlotAllocator(limits.num_slots, reserve_zero=True)
        self.rows = RowAllocator(limits.max_rows)
        self.aux = AuxTracker(limits.aux_slots, limits.track_chunk) if limits.aux_slots else None
        on_evict_aux = self.aux.on_evict if self.aux is not None else None
        self.tree = RadixCache(self.slots, on_evict_aux) if limits.cache_enabled else None
        if self.aux is not None:
            self.aux.attach(self.tree)
        self.waiting = WaitingQueue()
        self._live: dict[str, Request] = {}  # waiting and running, by rid (unique per scheduler)
        self.running: list[Request] = []
        self.draining: list[Request] = []
        self.completed: list[Request] = []
        self.inflight: dict[int, PlannedStep] = {}
        self.mask_clock = MaskClock()
        self.reserved = 0
        self._next_step_id = 0
        self._masks_due: list[Masks] = []
        self._new_rows: list[Request] = []  # admitted since the last step: their RowSampling goes with it

    # ---- admission -------------------------------------------------------------------
    def validate(self, prompt_ids: list[int], max_tokens: int, temperature: float) -> int:
        """Check a request against the limits; return its effective max new tokens."""
        return validate_request(self.limits, self.slots.capacity, prompt_ids, max_tokens, temperature)

    def add(self, req: Request) -> None:
        assert req.rid not in self._live, f"request id {req.rid!r} is live already"
        self.waiting.append(req)
        self._live[req.rid] = req

    def adopt_waiting(self, waiting: WaitingQueue) -> None:
        """Take over another scheduler's waiting requests (after a worker restart)."""
        for req in waiting:
            self.add(req)

    def _try_admit(self, req: Request) -> bool:
        if self.rows.free_count == 0:
            return False
        match = None
        prefix_slots: list[int] = []
        # A prompt-logprobs request runs its whole prompt: a cached prefix has no logits.
        if self.tree is not None and req.prefill_target > 0 and req.params.prompt_logprobs < 0:
            match = self.tree.match_prefix(req.prompt_ids[: req.prefill_target])
            usable = len(match.slots) if self.aux is None else AuxTracker.usable_prefix(match)
            prefix_slots = match.slots[:usable]
            self.tree.lock(match.node)
        need = (req.prefill_target - len(prefix_slots)) + req.max_new
        evictable = self.tree.evictable_size if self.tree is not None else 0
        fits = self.slots.free_count + evictable - self.reserved >= need
        if not fits or (self.aux is not None and not self.aux.admit(req, match, len(prefix_slots), self.running)):
            if match is not None:
                self.tree.unlock(match.node)
            return False
        row = self.rows.alloc()
        assert row is not None
        req.row = row
        if not req.admitted_at:  # its wait in the queue ends (a re-admission after a restart keeps the first)
            req.admitted_at = time.monotonic()
        req.slots = list(prefix_slots)
        req.prefix_len = req.prefilled = req.cached_len = len(prefix_slots)
        req.prompt_logprobs = []
        req.tree_node = match.node if match is not None else None
        req.reserved = need
        self.reserved += need
        self.running.append(req)
        self._new_rows.append(req)
        return True

    def _alloc(self, req: Request, n: int) -> list[int]:
        if self.slots.free_count < n and self.tree is not None:
            # Evict in batches: each eviction pass walks the tree's leaves, so doing it for
            # every decode token of a full pool would cost O(tree) per request per step.
            batch = max(n - self.slots.free_count, self.slots.capacity // 64, 16)
            self.tree.evict(batch)
        got = self.slots.alloc(n)
        assert got is not None, "reservation accounting broke: no slots for an admitted request"
        req.reserved -= n
        self.reserved -= n
        req.slots.extend(got)
        return got

    def _alloc_decode(self, reqs: list[Request]) -> list[int]:
        """One slot for each request's next decode token, in order (as ``_alloc(req, 1)`` each)."""
        n = len(reqs)
        if self.slots.free_count < n:
            return [self._alloc(req, 1)[0] for req in reqs]  # evicts as it goes, like one at a time
        got = self.slots.alloc(n)
        assert got is not None
        for req, slot in zip(reqs, got):
            req.reserved -= 1
            req.slots.append(slot)
        self.reserved -= n
        return got

    # ---- planning --------------------------------------------------------------------
    def next_step(self) -> PlannedStep | None:
        """Plan the next worker step, or None when there is nothing to run."""
        lim = self.limits
        decode_reqs = [r for r in self.running if r.wants_decode]
        decoding = len(decode_reqs)
        running_before = len(self.running)
        budget = lim.max_step_tokens - decoding
        # Chunks bound how long decoding rows wait for a step; with none decoding, a prompt
        # may take the whole step (a lone long prompt prefills in fewer, larger steps).
        chunk = lim.prefill_chunk if decoding else lim.max_step_tokens
        prefills: list[PrefillChunk] = []
        prefill_reqs: list[Request] = []
        # Every running request decoding: none is still prefilling.
        candidates = [r for r in self.running if not r.prefill_done] if decoding < running_before else []
        while True:
            for req in candidates:
                while budget > 0 and not req.prefill_done:
                    start = req.prefilled
                    whole = min(req.prefill_target - start, chunk)
                    if budget < whole and prefills:
                        # Cutting this chunk just to fill the budget makes odd shapes (a new
                        # kernel build each on a GPU) and splits equal-length batches: close
                        # the step and run the chunk whole in the next one.
                        budget = 0
                        break
                    n = min(whole, budget)
                    if self.aux is not None:
                        n = self.aux.clip_chunk(req, start, n)
                    prefills.append(prompt_chunk(req, start, n, self._alloc(req, n), self.aux))
                    prefill_reqs.append(req)
                    req.prefilled += n
                    budget -= n
                    self._cache_prefilled(req)
            candidates = []
            while self.waiting and budget > 0 and self._try_admit(self.waiting.peek()):
                req = self.waiting.popleft()
                if req.prefill_done:  # one-token prompt or full-prefix hit: straight to decode
                    if (chunk_only := table_chunk(req, self.aux)) is not None:
                        prefills.append(chunk_only)
                    continue
                candidates.append(req)
                break  # prefill it first, so the next admission can match what it inserts
            if not candidates:
                break
        if prefill_reqs or len(self.running) != running_before:
            # Prompts finished or requests admitted: they may decode in this step too.
            decode_reqs = [r for r in self.running if r.wants_decode]
        if not prefills and not decode_reqs:
            return None
        decode = None
        if decode_reqs:
            decode = build_decode(decode_reqs, self._alloc_decode(decode_reqs), self.aux is not None,
                                  self.mask_clock)
        samplings = [row_sampling(r, self.eos_ids) for r in self._new_rows if r.row >= 0 and not r.finished]
        self._new_rows = []
        step = Step(step_id=self._next_step_id, prefills=prefills, decode=decode, samplings=samplings)
        self._next_step_id += 1
        planned = PlannedStep(step, decode_reqs, prefill_reqs)
        for req in planned.requests():
            req.inflight_steps += 1
        self.inflight[step.step_id] = planned
        return planned

    def _cache_prefilled(self, req: Request) -> None:
        """Share what a request has prefilled so far with later requests right away.

        Attention models insert after every chunk; hybrid models only where the state
        was snapshotted, once the prompt is done.
        """
        if self.tree is None or req.prefill_target == 0:
            return
        if self.aux is not None:
            if not req.prefill_done:
                return
            # Hybrid: a prefix is only reusable where its state was snapshotted.
            for length, slot in req.aux_snapshots:
                result = self._insert(req, req.prompt_ids[:length], aux_slot=slot)
                self.aux.hand_over(req, slot, result.aux_accepted)
            req.aux_snapshots = []
            return
        self._insert(req, req.prompt_ids[: req.prefilled])

    def _insert(self, req: Request, tokens: list[int], aux_slot: int | None = None) -> InsertResult:
        assert self.tree is not None
        n = len(tokens)
        result = self.tree.insert(tokens, req.slots[:n], aux_slot)
        req.dup_slots.extend(result.duplicate_slots)
        assert result.node is not None and len(result.tree_slots) == n
        self.tree.lock(result.node)
        if req.tree_node is not None:
            self.tree.unlock(req.tree_node)
        req.tree_node = result.node
        req.slots[:n] = result.tree_slots
        req.cached_len = n
        return result

    # ---- results ---------------------------------------------------------------------
    def on_step_done(
        self, step_id: int, tokens: list[int], logprobs: tuple[list, list, list] | None = None,
        prompt_logprobs: Sequence[PromptLogprobs] = (),
    ) -> list[StepOutput]:
        """Take a step's tokens (and, when a row asked, logprobs, top ids, top logprobs; and the
        prompt logprobs of its chunks that asked)."""
        planned = self.inflight.pop(step_id)
        assert len(tokens) == len(planned.decode_reqs), "worker returned a wrong number of tokens"
        outputs = []
        for req in planned.requests():
            req.inflight_steps -= 1
        if prompt_logprobs:
            take_prompt_logprobs({req.row: req for req in planned.prefill_reqs}, prompt_logprobs)
        lps, top_ids, top_lps = logprobs if logprobs is not None and logprobs[0] else (None, None, None)
        eos_ids = self.eos_ids
        for i, (req, token) in enumerate(zip(planned.decode_reqs, tokens)):
            if req.finished:
                req.extra_ids.append(token)  # chained past its end: not returned, but its K/V is valid
                continue
            entry = None
            if req.params.logprobs and lps is not None:
                n = req.params.top_logprobs
                # Tuples of numbers only: the collector stops tracking them, so a long stream's
                # logprobs do not make every full collection slower.
                entry = (token, lps[i], tuple(zip(top_ids[i], top_lps[i]))[:n] if n else ())
            reason = take_token(req, token, eos_ids, entry)
            if reason is not None:
                self.finish(req, reason)
            outputs.append(StepOutput(req, [token], reason is not None, [entry] if entry else None))
        self._queue_masks(step_id + 1)
        for req in [r for r in self.draining if r.inflight_steps == 0]:
            self.draining.remove(req)
            self._release(req)
        if self.debug_invariants:
            self.check_invariants()
        return outputs

    def _queue_masks(self, step_id: int) -> None:
        """The masks of step ``step_id``'s deferred rows, now that their last tokens are in."""
        planned = self.inflight.get(step_id)
        if planned is not None and (masks := deferred_masks(planned.step, planned.decode_reqs, self.mask_clock)):
            self._masks_due.append(masks)

    def take_masks(self) -> list[Masks]:
        """``Masks`` messages to send to the worker now (before any new step)."""
        due, self._masks_due = self._masks_due, []
        return due

    def on_step_failed(self, step_id: int, error: str) -> list[Request]:
        """A step raised in the worker: fail every running request (their device state is suspect)."""
        self.inflight.pop(step_id, None)
        self._queue_masks(step_id + 1)  # the worker may wait for them: any mask will do now
        failed = [r for r in self.running]
        for req in failed:
            req.error = f"the worker failed a step: {error}"
            self.finish(req, "error")
        self._drop_draining()
        return failed

    def _drop_draining(self) -> None:
        for req in self.draining:
            self._release(req, cache=False)  # its launched steps will never report
        self.draining = []

    def finish(self, req: Request, reason: str) -> None:
        """End a request now; release its row, slots and state once no launched step still uses them."""
        if req.finished:
            return
        req.finish_reason = reason
        self._live.pop(req.rid, None)
        if req in self.waiting:
            self.waiting.remove(req)
            self.completed.append(req)
            return
        if req not in self.running:
            return
        self.running.remove(req)
        self.reserved -= req.reserved
        req.reserved = 0
        if self.aux is not None:
            self.aux.drop_reservation(req)
        if req.inflight_steps and reason != "error":
            self.draining.append(req)  # released when its last launched step comes back
        else:
            self._release(req)

    def _release(self, req: Request, cache: bool = True) -> None:
        """Cache what the request computed (every token fed to a finished step) and free the rest."""
        cache_it = cache and self.tree is not None and req.finish_reason != "error"
        fed = req.output_ids + req.extra_ids
        if not req.prefill_done:
            covered = req.prefilled
        elif req.decodes_launched == 0:
            covered = req.prefill_target
        else:
            covered = req.prompt_len + req.decodes_launched - 1
        covered = min(covered, req.prompt_len + len(fed))
        with_aux = self.aux is not None and req.aux_started and req.aux_slot >= 0
        keep = 0
        if cache_it and covered > 0:
            sequence = (req.prompt_ids + fed)[:covered]
            result = self._insert(req, sequence, aux_slot=req.aux_slot if with_aux else None)
            if with_aux:
                self.aux.hand_over(req, req.aux_slot, result.aux_accepted)
            keep = covered
        if self.tree is not None and req.tree_node is not None:
            self.tree.unlock(req.tree_node)
            req.tree_node = None
        self.slots.free(req.slots[max(keep, req.cached_len) :] + req.dup_slots)
        if self.aux is not None:
            self.aux.release(req)
        req.slots = []
        req.dup_slots = []
        self.rows.free(req.row)
        self.completed.append(req)

    def pop_completed(self) -> list[Request]:
        """Requests whose work is cached and released since the last call: reply to them now."""
        done, self.completed = self.completed, []
        return done

    def abort(self, rid: str) -> Request | None:
        """End a waiting or running request by id (O(1)); None if none is live."""
        req = self._live.get(rid)
        if req is not None:
            self.finish(req, "abort")
        return req

    def fail_all(self, reason: str) -> list[Request]:
        """The worker died: fail running requests, forget in-flight steps, reset the cache."""
        self._masks_due = []
        failed = list(self.running)
        for req in failed:
            req.error = reason
            self.finish(req, "error")
        self._drop_draining()
        self.inflight.clear()
        if self.tree is not None:
            self.tree.reset()
        return failed

    # ---- invariants ------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Every slot is exactly one of: free, owned by a running request, held by the tree."""
        check_scheduler(self)
