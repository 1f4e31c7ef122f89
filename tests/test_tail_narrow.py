"""A decode batch that only lost rows keeps the kernel path's decode tail (``DecodeTail.narrow``):
nothing is written in place, so the step need not wait for the one before it; the rows that left
reach the pool at the next flush, before anything reads their slots. Run on the CPU with the
CUDA kernels replaced by their reference computations."""

from __future__ import annotations

import random

import numpy as np
import pytest
from harness import InProcessService
from near_tie import assert_greedy_like_mlx
from test_paged_attention import _reference_kernels

from runtime.worker.paths import attention_paths
from runtime.worker.paths.cuda import decode_tail
from runtime.worker.paths.cuda.decode_tail import DecodeTail


@pytest.mark.parametrize("compiled", [True, False], ids=["compiled", "traced-each-step"])
@pytest.mark.parametrize("small_tail", [False, True], ids=["default-tail", "capacity-grows"])
def test_rows_that_leave_keep_the_tail_and_reach_the_pool_later(model_dir, monkeypatch, small_tail, compiled):
    """``small_tail``: tails of a few positions, so a batch that shrinks to a smaller row class
    gets a tail of a larger capacity (its held positions copied over). ``compiled``: the decode
    step compiled (``CompiledPagedDecode``) or built layer by layer."""
    _reference_kernels(monkeypatch)
    if small_tail:
        monkeypatch.setattr(attention_paths, "TAIL_STEPS", 3)
        monkeypatch.setattr(decode_tail, "TAIL_POSITIONS", 32)
    narrowed: list[tuple[int, int, bool]] = []  # (rows before, rows after, kept the tail)
    narrow = DecodeTail.narrow
    monkeypatch.setattr(DecodeTail, "narrow", lambda self, kept, *a: narrowed.append(
        (self.keys[0].shape[0], len(kept), (result := narrow(self, kept, *a)))) or result)
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=8, row_cache=False, compile_decode=compiled)
    assert (svc.engine.compiled_paged is not None) == compiled
    rng = random.Random(5)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(9 + 3 * i)], 4 + 3 * i) for i in range(6)]
    svc.run({0: reqs})  # all admitted together: afterwards rows only leave, one every few steps
    held = len(svc.engine.paths.tail.steps) + len(svc.engine.paths.tail.left)
    # A step failing now (before any prefill flushed the tail) must not lose the K/V of
    # requests that finished and were cached: the engine resets as after a failed step.
    svc.engine.reset_chain()
    # Prompts that extend finished requests' whole sequences read the K/V of their last decode
    # steps, which were in the tail when those rows left (the last one: when it finished).
    ended = [reqs[0], reqs[2], reqs[-1]]
    follows = [svc.request(f"follow{i}", r.prompt_ids + r.output_ids[:-1] + [5, 6, 7], 5) for i, r in enumerate(ended)]
    svc.run({0: follows})
    assert held  # something was still in the tail when the step failed
    kept = [entry for entry in narrowed if entry[2]]
    assert len(kept) >= 3, narrowed
    events = svc.engine.paths.tail.events  # (the worker trace's counts)
    assert events["narrowed"] == len(kept) and events["continued"] > events["narrowed"]
    if small_tail:  # from a row class of 8 down to 4 and 2: capacity 4 -> 8 -> 12
        assert any(before > after for before, after, _ in kept)
    assert all(f.prefix_len > len(r.prompt_ids) for f, r in zip(follows, ended))
    for r in reqs + follows:
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)


def test_a_batch_with_new_rows_still_flushes(model_dir, monkeypatch):
    """Only dropping rows keeps the tail: a batch that gained one (or reordered a chained row
    into a new one) is not a narrowing, and the flush runs as before."""
    from runtime.protocol.worker import DecodeBatch
    from runtime.worker.paths.deferred_steps import DeferredSteps

    steps = DeferredSteps(16)
    first = DecodeBatch(rows=[3, 5, 9], token_ids=[-1, -1, -1], positions=[10, 4, 7], slot_ids=[30, 50, 90],
                        temperatures=[0.0] * 3)
    steps.add(first, 1, np.array([3, 5, 9, 99]), np.array([10, 4, 7, 0]), [30, 50, 90, 0])
    dropped = DecodeBatch(rows=[3, 9], token_ids=[-1, -1], positions=[11, 8], slot_ids=[31, 91], temperatures=[0.0] * 2)
    assert steps.kept_rows(dropped, 0) == [0, 2]
    gained = DecodeBatch(rows=[3, 9, 4], token_ids=[-1, -1, 17], positions=[11, 8, 2], slot_ids=[31, 91, 42],
                         temperatures=[0.0] * 3)
    assert steps.kept_rows(gained, 1) is None  # a new row (with its own first token)
    fresh_token = DecodeBatch(rows=[3], token_ids=[12], positions=[11], slot_ids=[31], temperatures=[0.0])
    assert steps.kept_rows(fresh_token, 0) is None  # not chained
    where, left = steps.narrow([0, 2, -1, -1], np.array([3, 9, 99, 99]), dropped, 2)
    assert where == [1]
    rows, positions, slots = (a.tolist() for a in left)
    assert (rows, positions, slots) == ([5], [4], [50])  # the row that left, to be written at the next flush
    assert steps.take()[2].tolist() == [30, 90, 0, 0]  # the rest, padding rows to slot 0


@pytest.mark.parametrize("arch", ["qwen3_next", "falcon_h1"])
def test_a_hybrid_batch_that_loses_rows_keeps_its_states_resident(arch, model_dir, monkeypatch):
    """A hybrid's recurrent states stay resident when rows leave (``AuxPool._narrowed``): the
    rows that left are written before anything reads their slots, so prompts that extend
    finished requests restore their states exactly, also after a failed step's reset."""
    from runtime.worker.pools.aux_pool import AuxPool

    _reference_kernels(monkeypatch)
    narrowed: list[int] = []  # rows that left, at each narrowing
    narrow = AuxPool._narrowed
    monkeypatch.setattr(AuxPool, "_narrowed", lambda self, slots: (result := narrow(self, slots)) and narrowed.append(
        len(self.left[-1][0]) if self.left else 0) or result)
    folder = model_dir(arch)
    svc = InProcessService(folder, max_running=8, aux_slots=64, row_cache=False)
    assert not svc.aux_pool.narrows  # a CPU's pool keeps no narrowed batch: the GPU's choice, taken here
    svc.aux_pool.narrows = True
    rng = random.Random(7)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(9 + 3 * i)], 3 + 3 * i) for i in range(5)]
    svc.run({0: reqs})
    svc.engine.reset_chain()  # as after a failed step, before any prefill flushed
    ended = [reqs[0], reqs[1], reqs[-1]]
    follows = [svc.request(f"follow{i}", r.prompt_ids + r.output_ids[:-1] + [5, 6, 7], 4) for i, r in enumerate(ended)]
    svc.run({0: follows})
    assert sum(1 for n in narrowed if n) >= 2, narrowed
    assert all(f.prefix_len > len(r.prompt_ids) for f, r in zip(follows, ended))
    for r in reqs + follows:
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)


@pytest.mark.parametrize("seed", range(4))
def test_tail_bookkeeping_under_random_joins_and_leaves(seed, monkeypatch):
    """The decode tail's record against a plain model of where every (row, position) lives:
    random batches that continue, lose rows (``narrow``) or gain rows (a flush), with padding
    rows and small capacities. Every step the tail holds each row's last positions in order;
    after a final flush the pool and the slot table hold every position's K/V (a value made
    from its slot)."""
    import mlx.core as mx

    from runtime.protocol.worker import DecodeBatch
    from runtime.worker.model.discovery import AttentionShape
    from runtime.worker.pools.kv_pool import KVPool

    monkeypatch.setattr(decode_tail, "TAIL_POSITIONS", 16)
    rng = random.Random(seed)
    layers, padding_row, max_pos = 2, 31, 128
    pool = KVPool(layers, 4096, AttentionShape(n_heads=1, n_kv_heads=1, head_dim=2), mx.float32)
    table = mx.zeros((padding_row + 1, max_pos), dtype=mx.int32)
    tail = DecodeTail(layers, max_steps=3)
    active: dict[int, int] = {}  # row -> next position
    written: dict[tuple[int, int], int] = {}  # (row, position) -> slot
    next_slot, narrowed = 1, 0
    for _ in range(120):
        move = rng.random()
        if not active or move < 0.15:  # new rows join (a batch change the tail flushes for)
            for row in rng.sample([r for r in range(padding_row) if r not in active], rng.randint(1, 3)):
                active[row] = rng.randint(20, 40)
        elif move < 0.35 and len(active) > 1:  # rows leave
            for row in rng.sample(sorted(active), rng.randint(1, len(active) - 1)):
                del active[row]
        rows = sorted(active, key=lambda r: (r * 7919 + seed) % 31)  # a stable, unsorted order
        pad = (1 << (len(rows) - 1).bit_length()) - len(rows)
        slots = list(range(next_slot, next_slot + len(rows)))
        next_slot += len(rows)
        positions = [active[r] for r in rows]
        decode = DecodeBatch(rows=rows, token_ids=[-1] * len(rows), positions=positions, slot_ids=slots,
                             temperatures=[0.0] * len(rows))
        plan_rows = np.array(rows + [padding_row] * pad)
        plan_positions = np.array(positions + [0] * pad)
        if not tail.steps.continues(decode, pad):
            kept = tail.steps.kept_rows(decode, pad)
            if kept is not None and tail.narrow(kept, plan_rows, decode, pad):
                narrowed += 1
            else:
                tail.flush(pool, table)
        tail.steps.add(decode, pad, plan_rows, plan_positions, slots + [0] * pad)
        keys, values = tail.old(len(plan_rows), 1, 2, mx.float32)
        at = len(tail.steps) - 1
        value = mx.array([float(s) for s in slots + [0] * pad])[:, None, None, None].astype(mx.float32)
        for layer in range(layers):  # what the appending kernel writes: the step's K/V at the tail's end
            column = (mx.arange(keys[layer].shape[2]) == at)[None, None, :, None]
            tail.set(layer, mx.where(column, value + layer, keys[layer]), mx.where(column, -value - layer, values[layer]))
        for row, position, slot in zip(rows, positions, slots):
            written[(row, position)] = slot
            active[row] = position + 1
        # Every row of the batch: its last len(steps) positions, in order, are the tail's first.
        held = len(tail.steps)
        assert tail.keys[0].shape[2] == tail.capacity >= held
        for i, row in enumerate(rows):
            expected = [float(written[(row, active[row] - held + j)]) for j in range(held)]
            assert tail.keys[0][i, 0, :held, 0].tolist() == expected
    tail.flush(pool, table)
    assert narrowed >= 5 and not tail.left and len(tail.steps) == 0
    for (row, position), slot in written.items():
        assert table[row, position].item() == slot
        for layer in range(layers):
            assert pool.keys[layer][slot, 0, 0].item() == slot + layer
            assert pool.values[layer][slot, 0, 0].item() == -slot - layer


def test_a_failed_steps_reset_keeps_finished_requests_rows_on_the_row_cache_path(model_dir):
    """The CPU's row-cache path defers decode K/V into the pool too (``AttentionPaths.pending``): a
    reset after a failed step writes what evaluates, so prompts that extend finished (cached)
    requests read their last positions' K/V exactly."""
    folder = model_dir("llama")
    svc = InProcessService(folder, max_running=8, row_cache=True)
    assert svc.engine.paths.row_cache is not None
    rng = random.Random(9)
    reqs = [svc.request(f"r{i}", [rng.randrange(3, 250) for _ in range(9 + 3 * i)], 4 + 3 * i) for i in range(4)]
    svc.run({0: reqs})
    assert len(svc.engine.paths.pending)  # the last rows' decode K/V not in the pool yet
    svc.engine.reset_chain()
    follows = [svc.request(f"follow{i}", r.prompt_ids + r.output_ids[:-1] + [5, 6, 7], 4) for i, r in enumerate(reqs)]
    svc.run({0: follows})
    assert all(f.prefix_len > len(r.prompt_ids) for f, r in zip(follows, reqs))
    for r in reqs + follows:
        assert_greedy_like_mlx(folder, r.prompt_ids, r.output_ids, r.max_new, r.rid)
