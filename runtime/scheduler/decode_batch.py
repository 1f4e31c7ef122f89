"""The decode part of a step: one input token per decoding request, chained where it can be."""

from __future__ import annotations

from runtime.protocol.worker import DecodeBatch, Masks, Step
from runtime.scheduler.grammar import MaskClock
from runtime.scheduler.request import Request


def build_decode(reqs: list[Request], slot_ids: list[int], hybrid: bool, clock: MaskClock) -> DecodeBatch:
    """A DecodeBatch for ``reqs`` (each launches one more decode into its slot in ``slot_ids``).

    A request's first decode takes its last prompt token; later ones chain (-1: the worker's
    lazy token of the previous step). A constrained request whose last token is back sends it
    with this step's mask; one whose last token is still in flight chains too, and its mask
    follows in a ``Masks`` message (``deferred_rows``; ``Scheduler.take_masks``). Stop tokens
    are banned while a request is below its ``min_tokens``.
    """
    rows, tokens, positions, temps, ban_stop = [], [], [], [], []
    mask_rows, constrained, deferred = [], [], []
    for i, req in enumerate(reqs):
        k = req.decodes_launched
        params = req.params
        if k < params.min_tokens:
            ban_stop.append(i)
        rows.append(req.row)
        if req.constraint is None:
            tokens.append(req.prompt_ids[-1] if k == 0 else -1)
        elif k == len(req.output_ids):  # every launched decode's token is back
            tokens.append(req.prompt_ids[-1] if k == 0 else req.output_ids[-1])
            mask_rows.append(i)
            constrained.append(req.constraint)
        else:
            tokens.append(req.prompt_ids[-1] if k == 0 else -1)
            deferred.append(i)
        positions.append(len(req.prompt_ids) - 1 + k)
        temps.append(params.temperature)
        req.decodes_launched = k + 1
    aux_slots = [r.aux_slot for r in reqs] if hybrid else []
    masks = clock.masks(constrained) if constrained else []
    return DecodeBatch(rows, tokens, positions, slot_ids, temps, aux_slots, ban_stop, mask_rows, masks, deferred)


def deferred_masks(step: Step, reqs: list[Request], clock: MaskClock) -> Masks | None:
    """The ``Masks`` of ``step``'s deferred rows (``reqs``: its decode's requests), once the
    tokens before them advanced their grammars; None when it has none."""
    if step.decode is None or not step.decode.deferred_rows:
        return None
    return Masks(step.step_id, clock.masks([reqs[i].constraint for i in step.decode.deferred_rows]))
