"""Run the common prefill shapes once at start-up, so their kernel builds happen before requests.

Only where padding makes prefill shapes recur (a GPU: ``Engine.max_padding``). Fresh prompts
(position 0) are the shapes every service sees: each padded query length alone, and several
rows of the lengths a step's chunks take together. Shapes past a cached prefix (their key
length varies too) build on first use. The time is bounded: what is not warmed by the
deadline builds on first use, as it would without warm-up.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

from runtime.protocol.worker import PrefillChunk, Step
from runtime.worker.prefill_shapes import prefill_length

MAX_ROWS = 16


def common_shapes(max_step_tokens: int, prefill_chunk: int, max_rows: int) -> Iterator[tuple[int, int]]:
    """(rows, length) of the start-0 prefill forwards a service runs most, most common first:
    one row at every padded length a step allows, then 2, 4, .. rows of a chunk's lengths."""
    lengths = sorted({prefill_length(n) for n in range(1, max_step_tokens + 1)})
    yield from ((1, n) for n in lengths if n <= max_step_tokens)
    rows = 2
    while rows <= min(max_rows, MAX_ROWS):
        yield from ((rows, n) for n in lengths if n <= prefill_chunk and rows * n <= max_step_tokens)
        rows *= 2


def warm_prefill(engine, max_step_tokens: int, prefill_chunk: int, log: Callable[[str], None] | None = None) -> int:
    """Run ``common_shapes``; how many ran. Uses rows from 0 and pool slots from 1, which no
    request holds yet (the engine's own warm-up does too)."""
    if engine.max_padding <= 0 or engine.aux_pool is not None:
        return 0
    limit = min(engine.max_context, engine.pool.num_slots - 1)
    done = 0
    for rows, n in common_shapes(min(max_step_tokens, limit), prefill_chunk, engine.paths.max_rows):
        if rows * n > limit:
            continue
        chunks = [PrefillChunk(row=r, start=0, token_ids=[0] * n, slot_ids=list(range(1 + r * n, 1 + (r + 1) * n)))
                  for r in range(rows)]
        engine.finalize(engine.launch(Step(step_id=0, prefills=chunks, decode=None)))
        done += 1
        if log is not None and done % 20 == 0:
            log(f"runtime worker: warmed {done} prefill shapes")
    engine.reset_chain()
    return done
