"""The worker's diagnosis trace (``RUNTIME_WORKER_TRACE``): per-phase times and the slowest submits described."""

from __future__ import annotations

from types import SimpleNamespace

from runtime.protocol.worker import DecodeBatch, PrefillChunk, Step
from runtime.worker import step_trace
from runtime.worker.step_trace import StepTrace


class FakeEngine:
    def __init__(self, kernel_dir=None) -> None:
        self.shapes_built = (0, 0)
        self.kernel_dir = kernel_dir

    def build(self, step):
        return SimpleNamespace(step_id=step.step_id, step=step, in_place=step.step_id == 2)  # step 2: a tail flush

    def submit(self, built) -> None:
        self.prepare(built)
        self.shapes_built = (self.shapes_built[0] + len(built.step.prefills), self.shapes_built[1] + 1)

    def prepare(self, built) -> None:
        for chunk in built.step.prefills:  # a forward each
            self._prefill_batch([chunk])
        if built.step.prefills and self.kernel_dir is not None:  # as MLX writes a kernel it built
            (self.kernel_dir / f"kernel{built.step_id}.ptx").write_text("")

    def _prefill_batch(self, group) -> list:
        return []

    def finalize(self, built):
        return []


def test_slow_submits_are_described(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(step_trace, "SLOW_S", 0.0)
    kernels = tmp_path / "kernels"
    kernels.mkdir()
    (kernels / "old.ptx").write_text("")
    monkeypatch.setenv("MLX_PTX_CACHE_DIR", str(kernels))
    trace = StepTrace(str(tmp_path / "trace"))
    engine = FakeEngine(kernels)
    trace.wrap_engine(engine)
    decode = DecodeBatch(rows=[0, 1], token_ids=[-1, -1], positions=[5, 7], slot_ids=[9, 10], temperatures=[0.0, 0.7])
    prefills = [PrefillChunk(row=2, start=0, token_ids=[1, 2, 3], slot_ids=[11, 12, 13]),
                PrefillChunk(row=3, start=0, token_ids=[4], slot_ids=[14])]
    engine.submit(engine.build(Step(step_id=4, prefills=prefills, decode=decode)))
    engine.finalize(None)
    trace.write()
    text = (tmp_path / "trace").read_text()
    assert "submit" in text and "finalize" in text and "build" in text and "forward " in text
    assert ("step 4: 2 prefill chunks (4 tokens), 2 decode rows (sampled or masked); new prefill shapes 2, "
            "new decode traces 1; prepare ") in text
    assert " ms, 2 separate prefill forwards (built in " in text and " ms); queueing " in text
    assert " GB active, peak " in text and " GB in the submit, " in text and " GB cached, limit " in text
    assert "kernel cache files +1 since the last slow submit" in text  # the one the step's prepare wrote


def test_step_times_are_tabled_by_what_the_steps_held(tmp_path) -> None:
    trace = StepTrace(str(tmp_path / "trace"))
    engine = FakeEngine()
    trace.wrap_engine(engine)
    decode = DecodeBatch(rows=[0, 1], token_ids=[-1, -1], positions=[5, 7], slot_ids=[9, 10], temperatures=[0.0, 0.0])
    prefill = PrefillChunk(row=2, start=0, token_ids=list(range(300)), slot_ids=list(range(300)))
    for step_id in range(3):
        built = engine.build(Step(step_id=step_id, prefills=[prefill] if step_id == 0 else [], decode=decode))
        engine.submit(built)
        engine.finalize(built)
    trace.write()
    lines = (tmp_path / "trace").read_text().splitlines()
    table = {" ".join(line.rsplit(None, 4)[0].split()): int(line.rsplit(None, 4)[1]) for line in lines
             if line.startswith("  prefill")}
    assert table == {"prefill 257-512, decode 2-8": 1, "prefill 0, decode 2-8": 1,
                     "prefill 0, decode 2-8, in place": 1}


def test_tail_and_state_events_are_counted_from_when_the_trace_began(tmp_path) -> None:
    from collections import Counter

    engine = FakeEngine()
    engine.paths = SimpleNamespace(tail=SimpleNamespace(events=Counter({"continued": 40, "flushed (full)": 2})))
    engine.aux_pool = SimpleNamespace(events=Counter({"resident": 5}))
    trace = StepTrace(str(tmp_path / "trace"))
    trace.wrap_engine(engine)  # (the warm-up's events came before)
    engine.paths.tail.events.update({"continued": 7, "narrowed": 3})
    engine.aux_pool.events.update({"narrowed": 2, "written back": 1})
    trace.write()
    text = (tmp_path / "trace").read_text()
    assert "decode tail: continued 7, narrowed 3\n" in text
    assert "recurrent states: narrowed 2, written back 1\n" in text
