"""The scheduler's bookkeeping invariants, checked after every step in tests (``debug_invariants``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.scheduler.core import Scheduler


def check_scheduler(s: Scheduler) -> None:
    """Every slot is exactly one of: free, owned by a running request, held by the tree; every
    row is free or running or draining; reservations are covered; aux slots are consistent."""
    s.slots.check_invariants()
    s.rows.check_invariants()
    tree_slots = s.tree.owned_slots() if s.tree is not None else set()
    if s.tree is not None:
        s.tree.check_invariants()
    owned: list[int] = []
    for req in s.running + s.draining:
        owned.extend(req.slots[req.cached_len :])
        owned.extend(req.dup_slots)
        assert set(req.slots[: req.cached_len]) <= tree_slots, f"{req.rid}: cached slots not in tree"
    assert len(owned) == len(set(owned)), "a slot is owned twice"
    assert not (set(owned) & tree_slots), "a slot is owned by a request and the tree"
    free = s.slots.free_count
    assert free + len(owned) + len(tree_slots) == s.slots.capacity, (
        f"slot leak: free {free} + requests {len(owned)} + tree {len(tree_slots)} != {s.slots.capacity}"
    )
    assert s.reserved == sum(r.reserved for r in s.running)
    evictable = s.tree.evictable_size if s.tree is not None else 0
    assert free + evictable >= s.reserved, "reservations exceed reclaimable slots"
    assert s.rows.free_count + len(s.running) + len(s.draining) == s.rows.max_rows
    if s.aux is not None:
        s.aux.check_invariants(s.running + s.draining)
