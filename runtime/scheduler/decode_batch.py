"""The decode part of a step: one input token per decoding request, chained where it can be."""

from __future__ import annotations

from collections.abc import Callable

from runtime.protocol.worker import DecodeBatch
from runtime.scheduler.request import Request


def build_decode(reqs: list[Request], alloc_slot: Callable[[Request], int], hybrid: bool) -> DecodeBatch:
    """A DecodeBatch for ``reqs`` (each launches one more decode).

    A request's first decode takes its last prompt token; later ones chain (-1: the worker's
    lazy token of the previous step), except for a constrained request, whose last token is
    back (``Request.wants_decode``) and whose grammar gives this step's mask. Stop tokens are
    banned while a request is below its ``min_tokens``.
    """
    rows, tokens, positions, slot_ids, temps, ban_stop = [], [], [], [], [], []
    mask_rows, masks = [], []
    for i, req in enumerate(reqs):
        k = req.decodes_launched
        if k < req.params.min_tokens:
            ban_stop.append(i)
        rows.append(req.row)
        if req.constraint is not None:
            tokens.append(req.prompt_ids[-1] if k == 0 else req.output_ids[-1])
            mask_rows.append(i)
            masks.append(req.constraint.mask())
        else:
            tokens.append(req.prompt_ids[-1] if k == 0 else -1)
        positions.append(req.prompt_len - 1 + k)
        slot_ids.append(alloc_slot(req))
        temps.append(req.params.temperature)
        req.decodes_launched += 1
    aux_slots = [r.aux_slot for r in reqs] if hybrid else []
    return DecodeBatch(rows, tokens, positions, slot_ids, temps, aux_slots, ban_stop, mask_rows, masks)
