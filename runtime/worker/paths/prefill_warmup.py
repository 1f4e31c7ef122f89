"""Run the common prefill shapes once at start-up, so their kernel builds happen before requests.

Only where padding makes prefill shapes recur (a GPU: ``Engine.max_padding``). Fresh prompts
(position 0) are the shapes every service sees: each padded query length alone, and several
rows of the lengths a step's chunks take together. Past position 0 (a long prompt's later
chunks, a prefix hit's suffix) one row of each power-of-two query length at each rounded key
length up to ``CONTINUATION_KEYS``, then 2 and 4 rows of them (a step's chunks of one start: two
long prompts' second chunks, a prefix wave's suffixes; a hybrid's chunks of different starts).
The list is fixed by the step limits (about 110 + 70 + 140 shapes for 2048-token steps and
512-token chunks), not by a clock, so every tensor-parallel rank runs the same forwards. On an
H200 a restart warmed 283 shapes in 1.4 s (1B) and 2.3 s (8B); Qwen3-Next's shapes past
position 0 took about 18 ms each, those at position 0 about 180 ms (session 43). Rarer
shapes build on first use.

A hybrid (recurrent state) is warmed where its prompts are padded (``Engine.pads_recurrent``):
each row takes a state slot no request holds yet (1, 2, ..), fresh at position 0 and its own
live state past it, and those slots are cleared afterwards. Through leading layers only, rows at
position 0 read their (zeroed) slots instead of starting fresh: the layers not run must find a
state to write back.

The forwards run through the fewest leading layers that hold one of each kind of layer
(``warmup_layers``): the first one where every layer is alike, the first period of a hybrid's
pattern. Prefill is never traced, so nothing built here outlives the warm-up but the kernels.
"""

from __future__ import annotations

import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path

from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH, PrefillChunk, Step
from runtime.worker.paths.prefill_shapes import (
    continuation_length,
    key_length,
    prefill_length,
)
from runtime.worker.paths.warmup_layers import leading_layers_only

MAX_ROWS = 16
CONTINUATION_KEYS = 4096  # warm continuation shapes with at most this many keys
CONTINUATION_ROWS = (2, 4)  # ... and these row counts of them besides one


def common_shapes(max_step_tokens: int, prefill_chunk: int, max_rows: int, max_context: int = 0
                  ) -> Iterator[tuple[int, int, int]]:
    """(rows, length, start) of the prefill forwards a service runs most, most common first:
    one row at every padded length a step allows, then 2, 4, .. rows of a chunk's lengths,
    then (with ``max_context``) one row past position 0 at every continuation length and key
    length, then ``CONTINUATION_ROWS`` rows of those."""
    lengths = sorted({prefill_length(n) for n in range(1, max_step_tokens + 1)})
    yield from ((1, n, 0) for n in lengths if n <= max_step_tokens)
    rows = 2
    while rows <= min(max_rows, MAX_ROWS):
        yield from ((rows, n, 0) for n in lengths if n <= prefill_chunk and rows * n <= max_step_tokens)
        rows *= 2
    limit = min(max_context, CONTINUATION_KEYS)
    keys = sorted({key_length(s, 1, limit) for s in range(1, limit)})
    queries = sorted({continuation_length(n) for n in range(1, prefill_chunk + 1)})
    yield from ((1, n, k - n) for n in queries for k in keys if k - n > 0 and k <= limit)
    for rows in CONTINUATION_ROWS:
        if rows <= max_rows:
            yield from ((rows, n, k - n) for n in queries for k in keys
                        if rows * n <= max_step_tokens and k - n > 0 and k <= limit)


def warm_prefill(engine, max_step_tokens: int, prefill_chunk: int, log: Callable[[str], None] | None = None) -> int:
    """Run ``common_shapes``; how many ran. Uses rows from 0 and pool slots from 1, which no
    request holds yet (the engine's own warm-up does too)."""
    if engine.max_padding <= 0 or (engine.aux_pool is not None and not engine.pads_recurrent):
        return 0
    try:
        with leading_layers_only(engine.model, engine.layout) as layers:
            return _warm(engine, max_step_tokens, prefill_chunk, log, layers)
    except Exception as exc:  # noqa: BLE001 - a forward that needs every layer: warm them all
        where = traceback.extract_tb(exc.__traceback__)[-1]
        print(f"runtime worker: prefill warm-up through the leading layers failed ({type(exc).__name__}: "
              f"{str(exc)[:200]} at {Path(where.filename).name}:{where.lineno}); all layers run",
              file=sys.stderr, flush=True)
        engine.reset_chain()
        return _warm(engine, max_step_tokens, prefill_chunk, log, 0)


def _warm(engine, max_step_tokens: int, prefill_chunk: int, log: Callable[[str], None] | None, layers: int) -> int:
    limit = min(engine.max_context, engine.pool.num_slots - 1)
    aux = engine.aux_pool
    max_rows = engine.paths.max_rows if aux is None else min(engine.paths.max_rows, aux.num_slots - 1)
    done = 0
    for rows, n, start in common_shapes(min(max_step_tokens, limit), prefill_chunk, max_rows, limit):
        if start + rows * n >= engine.pool.num_slots:  # (the rows share the prefix's slots, then take their own)
            continue
        prefix = list(range(1, start + 1))
        chunks = [PrefillChunk(row=r, start=start, token_ids=[0] * n,
                               slot_ids=list(range(1 + start + r * n, 1 + start + (r + 1) * n)), prefix_slots=prefix,
                               **_state_fields(aux is not None, r, start, fresh=not layers))
                  for r in range(rows)]
        engine.settle()  # (the last shape's hold on the pools released: this one writes them in place)
        engine.finalize(engine.launch(Step(step_id=0, prefills=chunks, decode=None)))
        done += 1
        if log is not None and done % 20 == 0:
            log(f"runtime worker: warmed {done} prefill shapes"
                + (f" (through the first {layers} layer{'s' if layers > 1 else ''})" if layers else ""))
    if aux is not None:
        for slot in range(1, max_rows + 1):  # no request reads a state it did not write, but leave none behind
            aux.zero(slot)
    engine.reset_chain()
    return done


def _state_fields(recurrent: bool, row: int, start: int, fresh: bool) -> dict:
    """A warm-up chunk's state fields: a free slot a row (1, 2, ..), fresh at position 0 and its
    own live state past it (nothing for a model without recurrent state). Without ``fresh`` every
    row reads its slot (zeros at position 0): a forward through the leading layers leaves the
    later layers' states as they came in, and a fresh row has none to write back."""
    if not recurrent:
        return {}
    return {"aux_slot": 1 + row, "aux_source": AUX_CONTINUE if start or not fresh else AUX_FRESH}
