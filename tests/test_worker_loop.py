"""The worker loop's order of submits and reports, with a fake engine (no MLX arrays)."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from runtime.protocol.worker import (
    DecodeBatch,
    Masks,
    PrefillChunk,
    Shutdown,
    Step,
    StepDone,
    worker_encoder,
    worker_reply_decoder,
)
from runtime.worker.engine import LaunchedStep
from runtime.worker.main import IdleClock, _loop


@dataclass
class FakeEngine:
    """Records ``submit N`` / ``finalize N``; every step updates the pools in place (the CPU)."""

    events: list[str] = field(default_factory=list)
    shapes_built: tuple[int, int] = (0, 0)

    def build(self, step: Step) -> LaunchedStep:
        return LaunchedStep(step.step_id, step=step if step.prefills else None, first_tokens=bool(step.prefills))

    def submit(self, built: LaunchedStep) -> None:
        self.events.append(f"submit {built.step_id}")

    def finalize(self, launched: LaunchedStep) -> list[int]:
        self.events.append(f"finalize {launched.step_id}")
        return [launched.step_id]

    def reset_chain(self) -> None:
        pass

    def settle(self) -> None:
        if self.settles:
            self.events.append("settle")

    settles: bool = False  # record ``settle`` calls (only the test about them asks)


def _run(commands: list, overlap: bool = False, settles: bool = False) -> list[str]:
    engine = FakeEngine(settles=settles)
    inbox = [worker_encoder.encode(c) for c in commands]

    def send(data: bytes) -> None:
        reply = worker_reply_decoder.decode(data)
        assert isinstance(reply, StepDone)
        engine.events.append(f"send {reply.step_id}")

    def poll(timeout_ms: int) -> bool:
        return bool(inbox)

    assert _loop(engine, send, lambda: inbox.pop(0), poll, overlap, IdleClock(), parent=0) == 0
    return engine.events


def _decode(step_id: int) -> Step:
    return Step(step_id=step_id, prefills=[], decode=DecodeBatch(rows=[0], token_ids=[-1], positions=[8 + step_id],
                                                                  slot_ids=[9 + step_id], temperatures=[0.0]))


@pytest.mark.parametrize("overlap", [False, True], ids=["read-back-first", "submit-first"])
def test_first_tokens_are_reported_before_the_next_submit_steady_decode_after(overlap):
    prefill = Step(step_id=1, prefills=[PrefillChunk(row=0, start=0, token_ids=[1, 2, 3], slot_ids=[1, 2, 3])],
                   decode=DecodeBatch(rows=[0], token_ids=[3], positions=[3], slot_ids=[4], temperatures=[0.0]))
    events = _run([prefill, _decode(2), _decode(3), Shutdown()], overlap)
    # The prefill step's result (a request's first token) goes out before step 2 is submitted...
    assert events.index("send 1") < events.index("submit 2")
    # ...while a decode step's result waits for the next submit, so the device is never idle for it.
    assert events.index("submit 3") < events.index("send 2")
    assert [e for e in events if e.startswith("send")] == ["send 1", "send 2", "send 3"]


def test_an_in_place_step_is_submitted_after_the_read_back_and_a_settle():
    """A step that writes the pools in place goes to the device only after the step before it was
    read back and the engine settled (on CUDA: that step's hold on the pools released)."""
    prefill = Step(step_id=2, prefills=[PrefillChunk(row=1, start=0, token_ids=[1, 2, 3], slot_ids=[1, 2, 3])],
                   decode=DecodeBatch(rows=[0], token_ids=[-1], positions=[9], slot_ids=[10], temperatures=[0.0]))
    events = _run([_decode(1), prefill, Shutdown()], settles=True)
    assert events.index("finalize 1") < events.index("settle", events.index("finalize 1")) < events.index("submit 2")


@dataclass
class MaskingEngine(FakeEngine):
    """A fake engine whose steps with deferred rows wait for their ``Masks``."""

    def build(self, step: Step) -> LaunchedStep:
        launched = super().build(step)
        if step.decode is not None and step.decode.deferred_rows:
            launched.awaiting = step.decode
        return launched

    def apply_masks(self, launched: LaunchedStep, masks: list[bytes]) -> None:
        self.events.append(f"masks {launched.step_id}")
        launched.awaiting = None


def test_a_step_that_waited_for_masks_is_reported_at_once_and_every_step_once():
    """The scheduler needs a constrained step's tokens for the next step's masks: the step goes out
    as soon as it is sampled, before the next one is built, and no step is reported twice."""
    engine = MaskingEngine()
    deferred = Step(step_id=3, prefills=[], decode=DecodeBatch(rows=[0], token_ids=[-1], positions=[11],
                                                               slot_ids=[12], temperatures=[0.0], deferred_rows=[0]))
    inbox = [worker_encoder.encode(c) for c in [_decode(1), _decode(2), deferred, Masks(step_id=3, masks=[b"\xff"]),
                                                _decode(4), _decode(5), Shutdown()]]

    def send(data: bytes) -> None:
        engine.events.append(f"send {worker_reply_decoder.decode(data).step_id}")

    assert _loop(engine, send, lambda: inbox.pop(0), lambda timeout_ms: bool(inbox), False, IdleClock(), parent=0) == 0
    events = engine.events
    assert [e for e in events if e.startswith("send")] == [f"send {i}" for i in range(1, 6)]
    assert events.index("masks 3") < events.index("send 3") < events.index("submit 4")


def test_a_load_that_runs_out_of_device_memory_says_what_to_change():
    from runtime.worker.main import load_error

    oom = load_error(RuntimeError("cudaMallocAsync(&data, size, stream) failed: out of memory"))
    assert oom.startswith("RuntimeError: cudaMallocAsync") and "[cache] kv_slots" in oom
    assert load_error(ValueError("no config.json")) == "ValueError: no config.json"  # others as they are


def test_settling_waits_for_mlx_to_release_finished_work_only_on_cuda(monkeypatch):
    from types import SimpleNamespace

    import mlx.core as mx

    from runtime.worker import engine as engine_mod
    from runtime.worker.engine import Engine
    from runtime.worker.paths.cuda import released

    calls: list[str] = []
    monkeypatch.setattr(mx, "synchronize", lambda *a: calls.append("synchronize"))
    monkeypatch.setattr(engine_mod, "release_finished", released.release_finished)
    Engine.settle(SimpleNamespace(cuda=False))
    assert calls == []  # a CPU (or Metal) engine: nothing to wait for
    Engine.settle(SimpleNamespace(cuda=True))
    assert calls == ["synchronize"]
