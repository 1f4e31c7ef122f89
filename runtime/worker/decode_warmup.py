"""The worker's decode warm-up: what a decode step compiles on first use, compiled at start-up.

One short request (prefill, chained decode, a decode-tail flush) runs through the engine, and
the decode variants are prepared: the GPU kernel's builds, the compiled one-row step traced
at every length, the first step of every row class. A request then never waits for them.
The prefill shapes have their own warm-up (``paths/prefill_warmup.py``).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import mlx.core as mx

from runtime.protocol.worker import DecodeBatch, PrefillChunk, Step
from runtime.worker.paths.decode_plan import bucket_lengths, row_classes

if TYPE_CHECKING:
    from runtime.worker.engine import Engine

ROW_WARM_S = 20.0  # start-up time for the first decode step of each row class (GPU kernel path)


def warm_decode(engine: Engine, progress: Callable[[str], None] | None = None) -> int:
    """Prepare ``engine``'s decode variants, then run one short request through it. Uses row 0
    and low pool slots, which no request holds yet; how many variants were prepared.
    ``progress`` gets one line per stage."""
    clock = time.perf_counter()

    def stage(what: str, count: int) -> int:
        nonlocal clock
        if progress is not None and count:
            progress(f"{what}: {count} in {time.perf_counter() - clock:.1f} s")
        clock = time.perf_counter()
        return count

    variants = stage("decode kernel variants", engine.paths.warm_up(engine.LENGTH_BUCKET))
    # The traces a step replays are made with the delta-net kernel in place, as steps make them.
    traced = engine.gated_delta.scope
    ran = False
    if engine.compiled is not None:
        try:
            with traced():
                variants += stage("one-row decode traces", engine.compiled.trace(1))
            _run_request(engine)  # the compiled step's first real run
            ran = True
        except Exception as exc:  # noqa: BLE001 - a step MLX cannot compile on this device: serve uncompiled
            print(f"runtime worker: the compiled decode step failed at start-up ({str(exc)[:200]}); "
                  "decode runs uncompiled", file=sys.stderr, flush=True)
            engine.compiled = None
            engine.reset_chain()
            if engine.paths.row_cache is not None:
                engine.paths.row_cache.zero()
    if engine.compiled_paged is not None:
        assert engine.paths.device_table is not None
        lengths = bucket_lengths(engine.LENGTH_BUCKET, engine.max_context)

        def launches(rows: int) -> list[tuple[int, int]]:
            return sorted({engine.paths.launch(rows, n) for n in lengths})

        with traced():
            variants += stage("one-row decode traces",
                              engine.compiled_paged.trace(1, engine.paths.device_table, launches(1)))
            classes = row_classes(engine.paths.max_rows, smallest=2)
            variants += stage(f"first decode steps of {len(classes)} row classes",
                              engine.compiled_paged.warm_rows(classes, engine.paths.device_table, launches,
                                                              ROW_WARM_S))
    if not ran:
        _run_request(engine)
    return variants


def _run_request(engine: Engine) -> None:
    """One short request (prefill, chained decode, a decode-tail flush) on row 0 and low slots."""
    steps = (engine.paths.tail.capacity_for(1) if engine.paths.tail is not None else 0) + 2  # through a flush
    n = min(64, engine.max_context - steps, engine.pool.num_slots - 1 - steps)
    if engine.aux_pool is not None or n < 1:
        return  # a hybrid model's aux slots belong to the scheduler
    slots = list(range(1, n + steps + 1))
    prefill = PrefillChunk(row=0, start=0, token_ids=[0] * n, slot_ids=slots[:n])
    engine.finalize(engine.launch(Step(step_id=0, prefills=[prefill], decode=None)))
    for i in range(steps):
        decode = DecodeBatch(rows=[0], token_ids=[0 if i == 0 else -1], positions=[n + i],
                             slot_ids=[slots[n + i]], temperatures=[0.0])
        engine.finalize(engine.launch(Step(step_id=0, prefills=[], decode=decode)))
    engine.paths.flush()
    mx.eval(engine.state_arrays())
    engine.reset_chain()
