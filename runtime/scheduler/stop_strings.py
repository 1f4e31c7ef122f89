"""Stop strings matched on streamed text, across token boundaries, with a bounded hold-back."""

from __future__ import annotations


class StopMatcher:
    """Finds the first stop string in a stream of text deltas.

    `feed` returns the text that is safe to emit: it never includes a stop string, nor a tail
    that could still grow into one (that tail is held back). Invariants:
    - before a match, everything emitted plus `held` equals everything fed;
    - after a match, everything emitted equals the fed text up to the stop's start, and
      every later `feed` returns ("", stop) and `flush` returns "";
    - `held` is shorter than `max_len`, so memory is bounded by the longest stop string.

    When several stops are found in one buffer, the earliest-starting wins; among those that
    start together, the shortest (it is the one that completed first). A stop that ends inside
    another, earlier-starting stop is reported as soon as it completes; which one wins then
    depends on how the text was split into deltas.
    """

    def __init__(self, stops: list[str]) -> None:
        if not stops:
            raise ValueError("stops must list at least one stop string")
        for stop in stops:
            if not isinstance(stop, str) or not stop:
                raise ValueError(f"stops must be non-empty strings, got {stop!r}")
        self.stops: tuple[str, ...] = tuple(dict.fromkeys(stops))
        self.max_len: int = max(len(s) for s in self.stops)
        self.held: str = ""
        self.matched: str | None = None
        # Stops grouped by first character: most positions are ruled out by one set lookup.
        self._by_first: dict[str, tuple[str, ...]] = {}
        for stop in self.stops:
            self._by_first[stop[0]] = (*self._by_first.get(stop[0], ()), stop)

    def feed(self, delta: str) -> tuple[str, str | None]:
        """Take the next text delta; return (text safe to emit, the matched stop or None)."""
        if self.matched is not None:
            return "", self.matched
        text = self.held + delta
        # `held` never contains a whole stop, so any match ends inside `delta`.
        best_start, best_stop = -1, None
        for stop in self.stops:
            start = text.find(stop)
            if start < 0:
                continue
            if best_stop is None or (start, len(stop)) < (best_start, len(best_stop)):
                best_start, best_stop = start, stop
        if best_stop is not None:
            self.matched = best_stop
            self.held = ""
            return text[:best_start], best_stop
        hold_from = self._hold_start(text)
        self.held = text[hold_from:]
        return text[:hold_from], None

    def flush(self) -> str:
        """End of the request without a match: return the held-back text (and forget it)."""
        held, self.held = self.held, ""
        return held

    def _hold_start(self, text: str) -> int:
        """Where the longest suffix of `text` that is a prefix of some stop begins."""
        for i in range(max(0, len(text) - self.max_len + 1), len(text)):
            candidates = self._by_first.get(text[i])
            if candidates is not None:
                tail = text[i:]
                if any(stop.startswith(tail) for stop in candidates):
                    return i
        return len(text)
