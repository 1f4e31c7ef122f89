"""The waiting queue: first come, first served, with O(1) removal of any request."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator

from runtime.scheduler.request import Request


class WaitingQueue:
    """Requests admitted to the service but not yet running, oldest first.

    Every operation is O(1) (an ordered dict keyed by the request object), so aborting or
    finishing one of 100,000 queued requests costs the same as one of ten.
    """

    def __init__(self) -> None:
        self._items: OrderedDict[Request, None] = OrderedDict()

    def append(self, req: Request) -> None:
        self._items[req] = None

    def peek(self) -> Request:
        """The oldest request (the queue must not be empty)."""
        return next(iter(self._items))

    def popleft(self) -> Request:
        req, _ = self._items.popitem(last=False)
        return req

    def remove(self, req: Request) -> None:
        del self._items[req]

    def __contains__(self, req: object) -> bool:
        return req in self._items

    def __len__(self) -> int:
        return len(self._items)

    def __bool__(self) -> bool:
        return bool(self._items)

    def __iter__(self) -> Iterator[Request]:
        return iter(list(self._items))
