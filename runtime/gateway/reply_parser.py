"""Splits a chat reply, piece by piece as it streams, into content, reasoning and tool calls.

A state machine over text: ``content`` -> ``reasoning`` at a thinking start marker and back at
its end; ``content`` or ``reasoning`` -> ``tool`` at the tool-call start marker, back to
``content`` at its end marker. Markers never reach the output, and a suffix that may be the
beginning of a marker is held until the next piece tells (or the reply ends).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from runtime.gateway.tool_calls import Markup, ToolSyntax, parse_tool_calls


@dataclass
class Delta:
    """What one piece of reply adds: text per channel, and the tool calls that completed;
    ``parts`` has the same in the order written (``("content" | "reasoning", text)`` or
    ``("tool", call)``), for replies whose shape keeps that order (the Responses API's items)."""

    content: str = ""
    reasoning: str = ""
    tool_calls: list[dict] = field(default_factory=list)
    parts: list[tuple[str, Any]] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.content or self.reasoning or self.tool_calls)

    def add(self, other: Delta) -> None:
        self.content += other.content
        self.reasoning += other.reasoning
        self.tool_calls += other.tool_calls
        self.parts += other.parts

    def write(self, channel: str, text: str) -> None:
        """Append ``text`` to ``channel`` (content or reasoning)."""
        if not text:
            return
        if channel == "content":
            self.content += text
        else:
            self.reasoning += text
        if self.parts and self.parts[-1][0] == channel:
            self.parts[-1] = (channel, self.parts[-1][1] + text)
        else:
            self.parts.append((channel, text))


class ReplyParser:
    """One choice's reply; ``feed`` each text piece, then ``finish`` once.

    Invariant: everything fed is in exactly one of the returned deltas or in ``_pending``
    (held text of the current state), markers excepted.
    """

    def __init__(self, markup: Markup, *, tools: list[dict] | None = None, open_think_end: str | None = None) -> None:
        self._think = markup.think
        self._syntax: ToolSyntax | None = markup.tools if tools else None
        self._tools = tools
        # The prompt may have opened a thinking block: then the reply starts inside it.
        self._state = "content" if open_think_end is None else "reasoning"
        self._think_end = open_think_end or ""
        self._pending = ""
        self.made_tool_call = False
        self._starts: dict[tuple[str, str], frozenset[str]] = {}  # (state, think end) -> markers' first characters

    def _exits(self) -> list[tuple[str, str]]:
        """(marker, next state) from the current state."""
        out: list[tuple[str, str]] = []
        if self._state == "content":
            out += [(start, "reasoning") for start, _ in self._think]
        elif self._state == "reasoning":
            out.append((self._think_end, "content"))
        elif self._syntax is not None and self._syntax.end:
            return [(self._syntax.end, "content")]
        else:
            return []
        if self._syntax is not None:
            out.append((self._syntax.start, "tool"))
        return out

    def _emit(self, delta: Delta, text: str) -> None:
        if self._state in ("content", "reasoning"):
            delta.write(self._state, text)

    def _close_tool(self, delta: Delta, text: str, end: str) -> None:
        assert self._syntax is not None
        calls = parse_tool_calls(self._syntax, text, self._tools)
        if calls is None:  # keep what the model wrote rather than lose it
            delta.write("content", self._syntax.start + text + end)
        else:
            delta.tool_calls += calls
            delta.parts += [("tool", call) for call in calls]
            self.made_tool_call = self.made_tool_call or bool(calls)

    def _may_hold_marker(self, text: str) -> bool:
        """Whether ``text`` has a character that starts a marker out of the current state."""
        key = (self._state, self._think_end)
        starts = self._starts.get(key)
        if starts is None:
            starts = self._starts[key] = frozenset(m[0] for m, _ in self._exits() if m)
        return any(c in text for c in starts)

    def feed(self, text: str) -> Delta:
        """The delta that ``text`` (appended to the reply) makes certain."""
        delta = Delta()
        if not self._pending and self._state != "tool" and not self._may_hold_marker(text):
            self._emit(delta, text)  # the usual token: no marker can begin in it
            return delta
        self._pending += text
        while True:
            exits = self._exits()
            hits = [(self._pending.find(m), -len(m), m, state) for m, state in exits if m and m in self._pending]
            if not hits:
                break
            at, _, marker, state = min(hits)  # earliest, then longest marker
            before, self._pending = self._pending[:at], self._pending[at + len(marker):]
            if self._state == "tool":
                self._close_tool(delta, before, marker)
            else:
                self._emit(delta, before)
            if state == "reasoning":
                self._think_end = dict(self._think)[marker]
            self._state = state
        if self._state != "tool":
            hold = _possible_marker_prefix(self._pending, [m for m, _ in self._exits()])
            self._emit(delta, self._pending[:len(self._pending) - hold])
            self._pending = self._pending[len(self._pending) - hold:]
        return delta

    def finish(self) -> Delta:
        """The rest at the end of the reply: held text, and a tool call without its end marker."""
        delta = Delta()
        rest, self._pending = self._pending, ""
        if self._state == "tool":
            if rest.strip():
                self._close_tool(delta, rest, "")
        else:
            self._emit(delta, rest)
        return delta


def _possible_marker_prefix(text: str, markers: list[str]) -> int:
    """The length of the longest suffix of ``text`` that is a proper prefix of a marker."""
    best = 0
    for marker in markers:
        for size in range(min(len(marker) - 1, len(text)), best, -1):
            if text.endswith(marker[:size]):
                best = size
                break
    return best


def parse_reply(markup: Markup, text: str, *, tools: list[dict] | None = None,
                open_think_end: str | None = None) -> tuple[Delta, bool]:
    """A whole reply split at once: (its delta, whether it made a tool call)."""
    parser = ReplyParser(markup, tools=tools, open_think_end=open_think_end)
    delta = parser.feed(text)
    delta.add(parser.finish())
    return delta, parser.made_tool_call
