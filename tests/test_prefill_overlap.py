"""A step's prefill chunks and its decode: where the host waits for the device in between.

With the paged kernel's decode tail (CUDA), the decode of a prefill step writes no pool in
place, so the last prefill group is not evaluated on its own: the host encodes the decode
while the device runs the prefill. Without a tail every group is evaluated before the next
write. (The tail path itself runs only on CUDA; this checks the engine's choice with stubs.)
"""

from __future__ import annotations

from types import SimpleNamespace

import mlx.core as mx
import pytest

from runtime.protocol.worker import PrefillChunk, Step
from runtime.worker.engine import Engine, LaunchedStep


def _stub_engine(tail: object | None, order: list[str]) -> SimpleNamespace:
    engine = SimpleNamespace(
        paths=SimpleNamespace(tail=tail, flush=lambda: order.append("flush")),
        max_padding=0.25,
        aux_pool=None,
        pads_recurrent=False,
        mixed_starts=False,
        fuse_prefill=False,  # the separate forwards (tests/test_fused_step.py has the fused one)
        _prefill_batch=lambda group: order.append(f"prefill {group[0].start}") or [],  # no prompt logprobs
        _prefill=lambda chunk: order.append("hit"),
        _written=lambda: "written",
        _build_decode=lambda launched: order.append("decode"),
        settle=lambda: order.append("settle"),
    )
    engine._groups = lambda chunks: Engine._groups(engine, chunks)
    engine.fuses = lambda step: Engine.fuses(engine, step)
    return engine


def _step() -> Step:
    # Two starts: two groups (chunks of one start share a forward).
    chunks = [PrefillChunk(row=0, start=0, token_ids=[1, 2, 3], slot_ids=[1, 2, 3]),
              PrefillChunk(row=1, start=64, token_ids=[4, 5], slot_ids=[4, 5])]
    return Step(step_id=7, prefills=chunks, decode=None)


@pytest.mark.parametrize("tail, expected_evals", [(object(), 1), (None, 2)])
def test_last_prefill_group_is_left_to_the_submit_only_with_a_tail(monkeypatch, tail, expected_evals):
    evals: list[str] = []
    order: list[str] = []
    monkeypatch.setattr(mx, "eval", lambda *arrays: (evals.append("eval"), order.append("eval")))
    engine = _stub_engine(tail, order)
    step = _step()
    Engine.prepare(engine, LaunchedStep(step.step_id, step=step, first_tokens=True))
    assert len(evals) == expected_evals
    # The flush comes first and the decode last; every group but (with a tail) the last is
    # evaluated, and the engine settled, before the next group's writes are built.
    if tail is not None:
        assert order == ["flush", "prefill 0", "eval", "settle", "prefill 64", "decode"]
    else:
        assert order == ["flush", "prefill 0", "eval", "settle", "prefill 64", "eval", "settle", "decode"]
