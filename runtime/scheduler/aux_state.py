"""Auxiliary-state slot lifecycle for hybrid models (recurrent/conv state), no mlx.

Each running request owns a live slot; prefill snapshots the state into extra slots at
the last chunk-aligned prompt position, where the prompt leaves a cached path it could not
restore, and at the end of the prompt, and those snapshots become radix-tree values, so a later
request can restore the state at a cached prefix.
Invariant: every aux slot is free, owned by one running request, or held by the tree.
"""

from __future__ import annotations

from runtime.protocol.worker import AUX_CONTINUE, AUX_FRESH
from runtime.scheduler.radix import MatchResult, RadixCache
from runtime.scheduler.request import Request
from runtime.scheduler.slots import SlotAllocator


class AuxTracker:
    """Aux slot allocator plus per-request live slots, snapshot points and reservations."""

    def __init__(self, num_slots: int, track_chunk: int) -> None:
        self.slots = SlotAllocator(num_slots, reserve_zero=True)
        self.track_chunk = track_chunk
        self.tree: RadixCache | None = None
        self.reserved = 0

    def attach(self, tree: RadixCache | None) -> None:
        self.tree = tree

    @staticmethod
    def usable_prefix(match: MatchResult | None) -> int:
        """A hybrid prefix is reusable only as far as a saved state reaches."""
        if match is None or match.aux_slot is None:
            return 0
        return match.aux_len

    def snapshot_points(self, req: Request, prefix_len: int, matched: int = 0) -> list[int]:
        """Prompt lengths whose state is kept, ascending: the last chunk multiple past the prefix,
        the prompt end, and where the prompt leaves a cached path (``matched`` tokens of it in the
        tree, at least a chunk past the state it could restore) that length.

        The point where the prompt leaves a cached path serves shared prefixes: a system prompt
        followed by each user's own text is cached by the first request with no state inside it
        (its chunk multiple falls in its own text), so the second request, seeing the shared part
        matched but not restorable, keeps the state at its end; every later one restores it.
        A chat request also names where its system part ends (``req.shared_prefix``), so its
        first request keeps the state there already."""
        if self.tree is None:
            return []
        target = req.prefill_target
        points = set()
        aligned = prefix_len + (target - prefix_len) // self.track_chunk * self.track_chunk
        if prefix_len < aligned < target:
            points.add(aligned)
        for shared in (matched, req.shared_prefix):  # (the hint: where a chat's system part ends)
            if shared - prefix_len >= self.track_chunk and shared < target:
                points.add(shared)
        if target > prefix_len:
            points.add(target)
        return sorted(points)

    def _make_room(self, n: int, restore: int | None, running: list[Request]) -> bool:
        """Free slots until ``n`` are unreserved: evict unlocked tree leaves first; then drop the
        states of tree nodes (locked ones too: a request locks its whole matched path, and a long
        shared path can hold most of the pool), except ``restore`` and the states ``running``
        requests have yet to restore."""
        keep: set[int] | None = None
        while self.slots.free_count - self.reserved < n:
            if self.tree is None:
                return False
            if self.tree.evict(1) == 0:
                if keep is None:  # (only under pressure: the scan of the running requests)
                    keep = self.pending_sources(running) | ({restore} if restore is not None else set())
                if not self.tree.drop_aux(keep):
                    return False
        return True

    def admit(self, req: Request, match: MatchResult | None, prefix_len: int, running: list[Request]) -> bool:
        """Take a live slot and reserve the snapshot slots; False (taking nothing) if none can be had.
        ``running``: the admitted requests, whose states to restore are never dropped for room."""
        points = self.snapshot_points(req, prefix_len, len(match.slots) if match is not None else 0)
        restore = match.aux_slot if prefix_len > 0 and match is not None else None
        if not self._make_room(1 + len(points), restore, running):
            return False
        live = self.slots.alloc(1)
        assert live is not None
        req.aux_slot = live[0]
        req.aux_owned = [live[0]]
        req.aux_points = points
        req.aux_reserved = len(points)
        self.reserved += len(points)
        req.aux_source = match.aux_slot if prefix_len > 0 and match is not None else AUX_FRESH
        req.aux_snapshots = []
        req.aux_started = False
        return True

    def clip_chunk(self, req: Request, start: int, n: int) -> int:
        """Split prefill so a chunk ends exactly at every snapshot point."""
        for point in req.aux_points:
            if start < point < start + n:
                return point - start
        return n

    def chunk_fields(self, req: Request, end: int) -> tuple[int, int, int]:
        """(aux_slot, aux_source, aux_snapshot) for a chunk of ``req`` ending at prompt length ``end``."""
        source = AUX_CONTINUE if req.aux_started else req.aux_source
        req.aux_started = True
        snapshot = -1
        if end in req.aux_points:
            got = self.slots.alloc(1)
            assert got is not None, "aux reservation broke"
            snapshot = got[0]
            req.aux_reserved -= 1
            self.reserved -= 1
            req.aux_owned.append(snapshot)
            req.aux_snapshots.append((end, snapshot))
        return req.aux_slot, source, snapshot

    def hand_over(self, req: Request, slot: int, accepted: bool) -> None:
        """A snapshot or live slot was offered to the tree: it owns it now, or it is freed."""
        req.aux_owned.remove(slot)
        if not accepted:
            self.slots.free([slot])

    def drop_reservation(self, req: Request) -> None:
        """The request will take no more snapshots."""
        self.reserved -= req.aux_reserved
        req.aux_reserved = 0

    def release(self, req: Request) -> None:
        """Free whatever aux slots the request still owns, and its reservation."""
        self.drop_reservation(req)
        if req.aux_owned:
            self.slots.free(req.aux_owned)
        req.aux_owned = []
        req.aux_slot = -1

    @staticmethod
    def pending_sources(running: list[Request]) -> set[int]:
        """The tree states admitted requests will restore in a chunk not yet planned."""
        return {r.aux_source for r in running if not r.aux_started and r.aux_source >= 0}

    def on_evict(self, slot: int) -> None:
        self.slots.free([slot])

    def check_invariants(self, running: list[Request]) -> None:
        self.slots.check_invariants()
        owned = [s for r in running for s in r.aux_owned]
        tree_aux = self.tree.owned_aux_slots() if self.tree is not None else set()
        assert len(owned) == len(set(owned)) and not (set(owned) & tree_aux), "aux slot owned twice"
        assert self.slots.free_count + len(owned) + len(tree_aux) == self.slots.capacity, (
            f"aux slot leak: free {self.slots.free_count} + requests {len(owned)} + tree {len(tree_aux)} "
            f"!= {self.slots.capacity}"
        )
        assert self.reserved == sum(r.aux_reserved for r in running)
        assert self.slots.free_count >= self.reserved
        # a state an admitted request has yet to restore is still the tree's (not dropped, not reused)
        assert self.pending_sources(running) <= tree_aux, "a state to restore was dropped"
