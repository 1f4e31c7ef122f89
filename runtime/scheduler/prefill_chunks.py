"""The worker's view of a request's prompt work: one chunk of its prompt, or its table row alone."""

from __future__ import annotations

from runtime.protocol.worker import AUX_CONTINUE, PrefillChunk
from runtime.scheduler.aux_state import AuxTracker
from runtime.scheduler.request import Request


def prompt_chunk(req: Request, start: int, n: int, slot_ids: list[int], aux: AuxTracker | None) -> PrefillChunk:
    """Positions ``start..start+n`` of ``req``'s prompt into ``slot_ids`` (allocated): the
    cached prefix's slots with its first chunk, the aux state's source and snapshot (hybrid
    models), and the next tokens when the request asked for prompt logprobs."""
    prefix = req.slots[:start] if start == req.prefix_len and start > 0 else []
    aux_slot, aux_source, aux_snapshot = aux.chunk_fields(req, start + n) if aux is not None else (-1, AUX_CONTINUE, -1)
    top_n = req.params.prompt_logprobs
    return PrefillChunk(
        req.row, start, req.prompt_ids[start : start + n], slot_ids, prefix, aux_slot, aux_source, aux_snapshot,
        req.prompt_ids[start + 1 : start + n + 1] if top_n >= 0 else [], max(top_n, 0),
    )


def table_chunk(req: Request, aux: AuxTracker | None) -> PrefillChunk | None:
    """A request admitted with nothing to prefill (a one-token prompt or a whole-prefix hit):
    the worker still needs the cached prefix's slots in its table row, and a hybrid model's
    live slot the prefix's saved state (or cleared); None when there is nothing to send."""
    if aux is not None:
        aux_slot, aux_source, _ = aux.chunk_fields(req, req.prefix_len)
        return PrefillChunk(req.row, req.prefix_len, [], [], list(req.slots), aux_slot, aux_source)
    if req.prefix_len:
        return PrefillChunk(req.row, req.prefix_len, [], [], list(req.slots))
    return None
