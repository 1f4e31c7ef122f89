"""The decode part of a step: one input token per decoding request, chained where it can be."""

from __future__ import annotations

from collections.abc import Callable

from runtime.protocol.worker import DecodeBatch, Masks, Step
from runtime.scheduler.grammar import masks_of
from runtime.scheduler.request import Request


def build_decode(reqs: list[Request], alloc_slot: Callable[[Request], int], hybrid: bool) -> DecodeBatch:
    """A DecodeBatch for ``reqs`` (each launches one more decode).

    A request's first decode takes its last prompt token; later ones chain (-1: the worker's
    lazy token of the previous step). A constrained request whose last token is back sends it
    with this step's mask; one whose last token is still in flight chains too, and its mask
    follows in a ``Masks`` message (``deferred_rows``; ``Scheduler.take_masks``). Stop tokens
    are banned while a request is below its ``min_tokens``.
    """
    rows, tokens, positions, slot_ids, temps, ban_stop = [], [], [], [], [], []
    mask_rows, constrained, deferred = [], [], []
    for i, req in enumerate(reqs):
        k = req.decodes_launched
        if k < req.params.min_tokens:
            ban_stop.append(i)
        rows.append(req.row)
        back = k == len(req.output_ids)  # every launched decode's token is back
        if req.constraint is not None and back:
            tokens.append(req.prompt_ids[-1] if k == 0 else req.output_ids[-1])
            mask_rows.append(i)
            constrained.append(req.constraint)
        else:
            tokens.append(req.prompt_ids[-1] if k == 0 else -1)
            if req.constraint is not None:
                deferred.append(i)
        positions.append(req.prompt_len - 1 + k)
        slot_ids.append(alloc_slot(req))
        temps.append(req.params.temperature)
        req.decodes_launched += 1
    aux_slots = [r.aux_slot for r in reqs] if hybrid else []
    masks = masks_of(constrained) if constrained else []
    return DecodeBatch(rows, tokens, positions, slot_ids, temps, aux_slots, ban_stop, mask_rows, masks, deferred)


def deferred_masks(step: Step, reqs: list[Request]) -> Masks | None:
    """The ``Masks`` of ``step``'s deferred rows (``reqs``: its decode's requests), once the
    tokens before them advanced their grammars; None when it has none."""
    if step.decode is None or not step.decode.deferred_rows:
        return None
    return Masks(step.step_id, masks_of([reqs[i].constraint for i in step.decode.deferred_rows]))
