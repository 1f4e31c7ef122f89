"""Request-table rows: each running request owns one row of the worker's slot table."""

from __future__ import annotations


class RowAllocator:
    """Free list of rows ``0..max_rows-1``; lowest row first."""

    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._free = list(range(max_rows - 1, -1, -1))

    @property
    def free_count(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        assert 0 <= row < self.max_rows and row not in self._free, f"bad row free {row}"
        self._free.append(row)
        self._free.sort(reverse=True)

    def check_invariants(self) -> None:
        assert len(set(self._free)) == len(self._free)
