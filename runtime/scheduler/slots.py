"""KV-slot allocator: hands out integer slot ids of the worker's KV pool."""

from __future__ import annotations


class SlotAllocator:
    """Free list over KV-pool slots ``[first_slot, num_slots)``.

    Invariant: every slot in range is either in the free list or owned by
    exactly one holder (a running request or the radix tree). Slot 0 is
    reserved as padding when ``reserve_zero`` is set.
    """

    def __init__(self, num_slots: int, reserve_zero: bool = True) -> None:
        self.num_slots = num_slots
        self.first_slot = 1 if reserve_zero else 0
        # Pop from the end: low slot ids are handed out first.
        self._free: list[int] = list(range(num_slots - 1, self.first_slot - 1, -1))
        self._is_free = bytearray(num_slots)
        for slot in self._free:
            self._is_free[slot] = 1

    @property
    def capacity(self) -> int:
        """Number of slots that can ever be handed out."""
        return self.num_slots - self.first_slot

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """Take ``n`` slots, or return None (taking nothing) if fewer are free."""
        if n > len(self._free):
            return None
        if n == 0:
            return []
        taken = self._free[-n:]
        del self._free[-n:]
        taken.reverse()
        for slot in taken:
            self._is_free[slot] = 0
        return taken

    def free(self, slots: list[int]) -> None:
        """Return slots to the free list; freeing a free slot is a bug."""
        for slot in slots:
            assert self.first_slot <= slot < self.num_slots, f"slot {slot} out of range"
            assert not self._is_free[slot], f"double free of slot {slot}"
            self._is_free[slot] = 1
        self._free.extend(reversed(slots))

    def is_free(self, slot: int) -> bool:
        return bool(self._is_free[slot])

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free), "duplicate slot in free list"
        assert sum(self._is_free) == len(self._free), "free bitmap out of step"
