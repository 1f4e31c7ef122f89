"""A hybrid's prefill chunks of different starts in one forward (``Engine.mixed_starts``, the pool
paths): the rounds that keep every chunk after the states it starts from, the mask, and tokens
that stay mlx-lm's with fewer forwards a step."""

from __future__ import annotations

import random

import mlx.core as mx
import numpy as np
import pytest
from harness import InProcessService
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from model_factory import reference_greedy
from test_hybrid_kernel_path import _kernels

from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH, PrefillChunk
from runtime.scheduler.admission import Limits
from runtime.scheduler.core import Scheduler
from runtime.scheduler.request import Request, SamplingParams
from runtime.worker.paths import attention_paths
from runtime.worker.paths.mixed_prefill import mixed_start_mask
from runtime.worker.paths.prefill_groups import MIXED_PAD_FLOOR, prefill_groups, state_rounds


def _chunk(row: int, start: int, n: int, aux_slot: int, source: int, snapshot: int = -1) -> PrefillChunk:
    return PrefillChunk(row, start, [5] * n, [1] * n, aux_slot=aux_slot, aux_source=source, aux_snapshot=snapshot)


# A prompt's head (snapshotting slot 20 at its tracking point) and its tail; a prompt restoring
# that snapshot in the same step; two restoring slots of an earlier step; a whole-prefix hit on
# the snapshot (no tokens).
STEP = [_chunk(0, 0, 32, 10, AUX_FRESH, snapshot=20), _chunk(0, 32, 6, 10, AUX_CONTINUE),
        _chunk(1, 32, 5, 11, 20), _chunk(2, 48, 6, 12, 7), _chunk(3, 32, 0, 13, 20), _chunk(4, 40, 6, 14, 8)]


def test_a_chunk_runs_a_round_after_the_state_it_starts_from():
    assert state_rounds(STEP) == [0, 1, 1, 0, 1, 0]
    # Continuing a chunk of the round before, twice over.
    assert state_rounds([_chunk(0, 0, 8, 4, AUX_FRESH), _chunk(0, 8, 8, 4, AUX_CONTINUE),
                         _chunk(0, 16, 8, 4, AUX_CONTINUE)]) == [0, 1, 2]


def test_rounds_group_chunks_of_different_starts():
    def summary(groups):
        return [[(c.row, c.start) for c in g] for g in groups]

    mixed = prefill_groups(STEP, True, 0.25, recurrent=True, pads_recurrent=True, mixed_starts=True)
    assert summary(mixed) == [[(0, 0)], [(2, 48), (4, 40)], [(1, 32), (0, 32)], [(3, 32)]]
    by_start = prefill_groups(STEP, True, 0.25, recurrent=True, pads_recurrent=True)
    assert summary(by_start) == [[(0, 0)], [(1, 32), (0, 32)], [(3, 32)], [(4, 40)], [(2, 48)]]
    # Where taking them by start gives no more batches, they are taken by start.
    assert prefill_groups(STEP[:5], True, 0.25, recurrent=True, pads_recurrent=True, mixed_starts=True) == \
        prefill_groups(STEP[:5], True, 0.25, recurrent=True, pads_recurrent=True)
    # Unpadded models (``pads_recurrent`` False) batch equal lengths only, of any start.
    equal = [_chunk(0, 16, 5, 1, AUX_CONTINUE), _chunk(1, 32, 5, 2, AUX_CONTINUE), _chunk(2, 16, 6, 3, AUX_CONTINUE)]
    assert summary(prefill_groups(equal, True, 0.25, recurrent=True, mixed_starts=True)) == [[(0, 16), (1, 32)], [(2, 16)]]


def test_short_chunks_pad_up_to_the_floor_where_starts_mix():
    tails = [_chunk(i, 64 * (i + 1), n, i + 1, AUX_CONTINUE) for i, n in enumerate((5, 20, 60, 61))]
    lengths = [[len(c.token_ids) for c in g]
               for g in prefill_groups(tails, True, 0.25, recurrent=True, pads_recurrent=True, mixed_starts=True)]
    assert lengths == [[5, 20, 60, 61]]  # 4 x 61 tokens, within MIXED_PAD_FLOOR
    assert MIXED_PAD_FLOOR == 512
    longer = [_chunk(i, 64 * (i + 1), n, i + 1, AUX_CONTINUE) for i, n in enumerate((5, 200, 200, 200))]
    lengths = [[len(c.token_ids) for c in g]
               for g in prefill_groups(longer, True, 0.25, recurrent=True, pads_recurrent=True, mixed_starts=True)]
    assert lengths == [[5, 200], [200, 200]]  # 3 x 200 is past the floor, and pads more than a quarter
    # Elsewhere the share of padding alone decides.
    assert len(prefill_groups(tails, True, 0.25, recurrent=True, pads_recurrent=True)) == 4


def test_each_row_sees_the_keys_up_to_its_own_position():
    mask = np.array(mixed_start_mask(np.array([0, 2]), 2, 5, 4))
    assert mask.shape == (2, 1, 2, 5)
    assert mask[0, 0].tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    assert mask[1, 0].tolist() == [[True, True, True, False, False], [True, True, True, True, False]]
    assert mixed_start_mask(np.array([0, 2]), 2, 5, 5).shape == (2, 1, 1, 2, 5)  # queries grouped in 5-D


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randint(3, 200) for _ in range(n)]


@pytest.mark.parametrize(("arch", "kernel"), [("qwen3_next", False), ("qwen3_next", True), ("falcon_h1", False),
                                               ("mamba", False)])
def test_mixed_start_forwards_keep_mlx_lms_tokens(model_dir, monkeypatch, arch, kernel):
    """Prompt tails past their tracking points and prefix hits' suffixes of different starts share
    forwards (padded where the model's recurrent layers allow it; Mamba's of equal length only),
    with the CUDA kernel path's rounded keys too (``kernel``: its reference kernels on the CPU)."""
    if kernel:
        _kernels(monkeypatch)
    folder = model_dir(arch)
    forwards = {}
    mixed = []
    build = attention_paths.mixed_prefill_batch
    monkeypatch.setattr(attention_paths, "mixed_prefill_batch",
                        lambda *a: mixed.append(sorted({c.start for c in a[1]})) or build(*a))
    for on in (False, True):
        svc = InProcessService(folder, max_running=8, aux_slots=64, track_chunk=16, max_step_tokens=256,
                               pad_shapes=True, row_cache=False)
        assert svc.engine.mixed_starts and (svc.engine.compiled_paged is not None) == kernel
        svc.engine.mixed_starts = on
        run = svc.engine._prefill_batch
        calls = []
        monkeypatch.setattr(svc.engine, "_prefill_batch", lambda group: calls.append(1) or run(group))
        rng = random.Random(5)
        shared = _ids(rng, 40)
        # Tails of 5, 5 and 13 tokens at 32, 16 and 16; two prompts on one prefix, the second
        # restoring the first's state at 32 in the same step.
        cold = [svc.request(f"c{i}", _ids(rng, n), 6) for i, n in enumerate((37, 21, 29, 12))]
        cold += [svc.request("s0", shared + _ids(rng, 3), 4), svc.request("s1", shared + _ids(rng, 7), 4)]
        svc.run({0: cold})
        first_step = len(calls)
        warm = [svc.request(f"w{i}", shared + _ids(rng, n), 6) for i, n in enumerate((2, 9, 5))]
        svc.run({0: warm})
        assert cold[-1].prefix_len == 32 and [r.prefix_len for r in warm] == [32, 32, 32]
        forwards[on] = first_step
        for r in cold + warm:
            assert r.output_ids == reference_greedy(folder, r.prompt_ids, r.max_new), (on, r.rid)
    assert mixed and all(len(starts) > 1 for starts in mixed)
    assert forwards[True] < forwards[False], forwards


SYSTEMS = [list(range(1, 1 + n)) for n in (40, 90, 150)]


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(st.tuples(st.integers(0, len(SYSTEMS)), st.integers(1, 120), st.integers(0, 6)), min_size=1,
                max_size=14),
       st.sampled_from([16, 32, 64]), st.booleans())
def test_hybrid_steps_group_every_chunk_after_what_it_reads(requests, track, pads):
    """The scheduler's own hybrid steps (prompts on shared prefixes arriving over a few steps, so
    that one restores a state another prompt of its step saves): every chunk in exactly one batch,
    after the batch that writes the state it starts from, at or after those writing the prefix
    K/V it reads, with rows of one kind of starting state (and of one length, unpadded)."""
    limits = Limits(4096, 8, 512, 1000, max_step_tokens=256, prefill_chunk=64, aux_slots=48, track_chunk=track)
    s = Scheduler(limits, frozenset({0}), debug_invariants=True)
    arrivals: dict[int, list[Request]] = {}
    for i, (system, own, at) in enumerate(requests):
        prompt = (SYSTEMS[system] if system < len(SYSTEMS) else []) + [300 + (i * 37 + j) % 600 for j in range(own)]
        arrivals.setdefault(at, []).append(Request(rid=f"r{i}", prompt_ids=prompt,
                                                   params=SamplingParams(max_tokens=2, ignore_eos=True), max_new=2))
    for step in range(200):
        for r in arrivals.pop(step, []):
            r.max_new = s.validate(r.prompt_ids, r.max_new, 0.0)
            s.add(r)
        p = s.next_step()
        if p is None:
            if not arrivals:
                break
            continue
        chunks = p.step.prefills
        groups = prefill_groups(chunks, True, 0.25, recurrent=True, pads_recurrent=pads, mixed_starts=True)
        at = {id(c): g for g, group in enumerate(groups) for c in group}
        assert sorted(map(id, chunks)) == sorted(at), "each chunk in exactly one batch"
        live: dict[int, int] = {}
        snapshot: dict[int, int] = {}
        written: dict[int, int] = {}
        for c in chunks:
            g = at[id(c)]
            if c.aux_source == AUX_CONTINUE and c.aux_slot in live:
                assert live[c.aux_slot] < g, "after its row's chunk before it"
            if c.aux_source >= 0 and c.aux_source in snapshot:
                assert snapshot[c.aux_source] < g, "after the chunk saving the state it restores"
            assert all(written.get(slot, -1) <= g for slot in c.prefix_slots), "at or after its prefix's K/V"
            live[c.aux_slot] = g
            if c.aux_snapshot >= 0:
                snapshot[c.aux_snapshot] = g
            written.update((slot, g) for slot in c.slot_ids)
        for group in groups:
            assert len({c.aux_source == AUX_FRESH for c in group}) == 1
            if not pads:
                assert len({len(c.token_ids) for c in group}) == 1
        s.on_step_done(p.step.step_id, [7] * len(p.decode_reqs))
    assert not arrivals


def test_a_row_near_the_context_end_does_not_cut_another_rows_chunk(model_dir):
    """A round's row 16 positions from the context end beside a longer chunk of another row: the
    batch's length is each row's own at least (the padding past the context end goes to slot 0)."""
    svc = InProcessService(model_dir("qwen3_next"), max_running=4, aux_slots=16, max_context=256, pad_shapes=True,
                           row_cache=False)
    near_end = PrefillChunk(0, 240, [5] * 10, list(range(300, 310)), aux_slot=1, aux_source=AUX_CONTINUE)
    longer = PrefillChunk(1, 10, [6] * 30, list(range(400, 430)), aux_slot=2, aux_source=AUX_CONTINUE)
    assert prefill_groups([near_end, longer], True, svc.engine.max_padding, recurrent=True, pads_recurrent=True,
                          mixed_starts=True) == [[near_end, longer]]
    _, tokens = svc.engine._prefill_inputs([near_end, longer])
    assert {len(t) for t in tokens} == {30}
    svc.engine._prefill_batch([near_end, longer])
    mx.eval(svc.engine._written())  # the forward runs
    assert (2, 30, 270) in svc.engine.prefill_shapes
