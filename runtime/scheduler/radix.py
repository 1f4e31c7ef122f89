"""Radix tree over token ids caching KV slots (SGLang RadixAttention style).

Each edge holds a run of token ids and the KV slot ids (one per token) that
hold their keys/values. A node may also carry an ``aux_slot``: an opaque int
(e.g. a recurrent-state slot of a hybrid model) describing the state *after*
the node's last token. The tree owns every slot it holds; slots go back to the
``SlotAllocator`` only on eviction or reset.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Callable

from runtime.scheduler.slots import SlotAllocator


class Node:
    """One radix-tree node; ``key``/``slots`` label the edge from its parent."""

    __slots__ = ("key", "slots", "children", "parent", "lock_ref", "last_access", "aux_slot", "nid")

    def __init__(self, key: list[int], slots: list[int], parent: Node | None, nid: int) -> None:
        self.key = key
        self.slots = slots
        self.children: dict[int, Node] = {}  # keyed by the child's first token
        self.parent = parent
        self.lock_ref = 0
        self.last_access = 0
        self.aux_slot: int | None = None
        self.nid = nid  # unique, breaks LRU ties deterministically in the heap

    def __repr__(self) -> str:
        return f"Node(key={self.key}, slots={self.slots}, lock={self.lock_ref}, aux={self.aux_slot})"


@dataclass(slots=True)
class MatchResult:
    """Result of ``match_prefix``.

    ``slots``: tree slots of the matched prefix (``len(slots)`` tokens matched).
    ``node``: deepest matched node, covering exactly the matched prefix (root if none).
    ``aux_slot``/``aux_len``: deepest aux slot on the matched path and the prefix
    length it describes (``None``/0 if none).
    """

    slots: list[int]
    node: Node
    aux_slot: int | None = None
    aux_len: int = 0


@dataclass(slots=True)
class InsertResult:
    """Result of ``insert``; see ``RadixCache.insert`` for the ownership contract."""

    dup_len: int
    aux_accepted: bool = False
    duplicate_slots: list[int] = field(default_factory=list)
    # The node ending at ``len(tokens)`` and the tree's slots for ``tokens`` (what
    # ``match_prefix(tokens)`` would return right after the insert).
    node: Node | None = None
    tree_slots: list[int] = field(default_factory=list)


def _common_len(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of ``a`` and ``b[start:]``."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class RadixCache:
    """Prefix cache mapping token sequences to KV slots, with LRU eviction.

    Nodes with ``lock_ref > 0`` (in use by a running request) are protected;
    the others are evictable, leaves first, least recently used first.
    """

    def __init__(self, allocator: SlotAllocator, on_evict_aux: Callable[[int], None] | None = None) -> None:
        self.allocator = allocator
        self.on_evict_aux: Callable[[int], None] = on_evict_aux or (lambda _aux: None)
        self._reset_state()

    def _reset_state(self) -> None:
        self._next_nid = 1
        self._clock = 0
        self.root = Node([], [], None, 0)
        self._evictable = 0
        self._protected = 0

    def _tick(self) -> int:
        # Logical clock: deterministic LRU independent of wall time.
        self._clock += 1
        return self._clock

    def _new_node(self, key: list[int], slots: list[int], parent: Node) -> Node:
        node = Node(key, slots, parent, self._next_nid)
        self._next_nid += 1
        parent.children[key[0]] = node
        return node

    def _split(self, node: Node, k: int) -> Node:
        """Split ``node``'s edge after ``k`` tokens; return the new upper node.

        ``node`` itself keeps the lower part so that references callers hold
        (locks, match results) still denote the same prefix. The aux slot stays
        on ``node`` since it describes the state at the end of the original edge.
        """
        assert 0 < k < len(node.key)
        parent = node.parent
        assert parent is not None
        upper = self._new_node(node.key[:k], node.slots[:k], parent)  # replaces node in parent.children
        upper.lock_ref = node.lock_ref  # same descendants' locks pass through it
        upper.last_access = node.last_access
        node.key = node.key[k:]
        node.slots = node.slots[k:]
        node.parent = upper
        upper.children[node.key[0]] = node
        return upper

    def match_prefix(self, tokens: list[int]) -> MatchResult:
        """Longest cached prefix of ``tokens``; refreshes LRU time on the path.

        The returned node is unlocked: lock it before anything can evict.
        """
        now = self._tick()
        node = self.root
        slots: list[int] = []
        aux_slot: int | None = None
        aux_len = 0
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_len(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access = now
            slots.extend(child.slots)
            i += k
            node = child
            if child.aux_slot is not None:
                aux_slot, aux_len = child.aux_slot, i
        return MatchResult(slots, node, aux_slot, aux_len)

    def lock(self, node: Node) -> None:
        """Protect ``node`` and its ancestors from eviction (reference counted)."""
        while node is not self.root:
            if node.lock_ref == 0:
                self._evictable -= len(node.slots)
                self._protected += len(node.slots)
            node.lock_ref += 1
            assert node.parent is not None
            node = node.parent

    def unlock(self, node: Node) -> None:
        """Undo one ``lock(node)``."""
        while node is not self.root:
            assert node.lock_ref > 0, f"unlock of unlocked {node!r}"
            node.lock_ref -= 1
            if node.lock_ref == 0:
                self._protected -= len(node.slots)
                self._evictable += len(node.slots)
            assert node.parent is not None
            node = node.parent

    def insert(self, tokens: list[int], slots: list[int], aux_slot: int | None = None) -> InsertResult:
        """Cache ``tokens`` whose KV lives in ``slots`` (same length).

        Ownership after the call, with ``r = insert(...)``:

        * ``slots[r.dup_len:]`` now belong to the tree; the caller must not free them.
        * ``slots[:r.dup_len]`` covered tokens already cached; the tree keeps its own
          slots there. Those positions where the caller's slot *equals* the tree's
          (e.g. obtained from ``match_prefix``) are tree-owned. The others are listed
          in ``r.duplicate_slots``: they stay the caller's, who must free them once
          it no longer reads them (or swap in the tree's via ``match_prefix``).
        * ``aux_slot``: if ``r.aux_accepted`` the tree owns it (attached to the node
          ending at ``len(tokens)``); otherwise (that node already has a different
          aux slot, or ``tokens`` is empty) the caller still owns it and must free it.
        """
        assert len(tokens) == len(slots), "one slot per token"
        now = self._tick()
        node = self.root
        duplicates: list[int] = []
        tree_slots: list[int] = []
        i = 0
        while i < len(tokens):
            child = node.children.get(tokens[i])
            if child is None:
                break
            k = _common_len(child.key, tokens, i)
            if k < len(child.key):
                child = self._split(child, k)
            for j, tree_slot in enumerate(child.slots):
                if slots[i + j] != tree_slot:
                    duplicates.append(slots[i + j])
            tree_slots.extend(child.slots)
            child.last_access = now
            i += k
            node = child
        dup_len = i
        if i < len(tokens):
            # New leaf starts unlocked even under a locked parent.
            node = self._new_node(list(tokens[i:]), list(slots[i:]), node)
            node.last_access = now
            self._evictable += len(tokens) - i
            tree_slots.extend(slots[i:])
        accepted = False
        if aux_slot is not None and node is not self.root:
            if node.aux_slot is None:
                node.aux_slot = aux_slot
                accepted = True
            else:
                accepted = node.aux_slot == aux_slot  # already ours: nothing to free
        return InsertResult(dup_len, accepted, duplicates, node, tree_slots)

    def evict(self, num_slots: int) -> int:
        """Free unlocked LRU leaves until ``num_slots`` slots are freed or none remain.

        Returns the number of slots returned to the allocator (may exceed the
        request, since whole nodes are evicted).
        """
        if num_slots <= 0:
            return 0
        heap = [(n.last_access, n.nid, n) for n in self._nodes() if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        freed = 0
        while freed < num_slots and heap:
            _, _, leaf = heapq.heappop(heap)
            self.allocator.free(leaf.slots)
            freed += len(leaf.slots)
            self._evictable -= len(leaf.slots)
            if leaf.aux_slot is not None:
                self.on_evict_aux(leaf.aux_slot)
                leaf.aux_slot = None
            parent = leaf.parent
            assert parent is not None
            del parent.children[leaf.key[0]]
            leaf.parent = None
            # A parent left childless becomes a candidate itself.
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, parent.nid, parent))
        return freed

    def drop_aux(self, keep: set[int]) -> bool:
        """Forget one node's aux value (the least recently used whose slot is not in ``keep``),
        locked or not, handing its slot to ``on_evict_aux``; False if there is none. The node's
        KV stays: a later match restores from an earlier state, or from none."""
        held = [n for n in self._nodes() if n.aux_slot is not None and n.aux_slot not in keep]
        if not held:
            return False
        node = min(held, key=lambda n: (n.last_access, n.nid))
        slot, node.aux_slot = node.aux_slot, None
        self.on_evict_aux(slot)
        return True

    @property
    def evictable_size(self) -> int:
        """Slots held by unlocked nodes."""
        return self._evictable

    @property
    def protected_size(self) -> int:
        """Slots held by locked nodes."""
        return self._protected

    @property
    def total_size(self) -> int:
        """All slots held by the tree."""
        return self._evictable + self._protected

    def _nodes(self) -> list[Node]:
        """All non-root nodes (iterative: deep trees must not hit the recursion limit)."""
        out: list[Node] = []
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(node.children.values())
        return out

    def owned_slots(self) -> set[int]:
        """Every KV slot currently owned by the tree."""
        return {s for n in self._nodes() for s in n.slots}

    def owned_aux_slots(self) -> set[int]:
        """Every aux slot currently owned by the tree."""
        return {n.aux_slot for n in self._nodes() if n.aux_slot is not None}

    def reset(self) -> None:
        """Free every slot and aux slot the tree holds, locked or not, and empty it."""
        for node in self._nodes():
            self.allocator.free(node.slots)
            if node.aux_slot is not None:
                self.on_evict_aux(node.aux_slot)
        self._reset_state()

    def check_invariants(self) -> None:
        """Assert structural and accounting invariants (for tests / debug)."""
        root = self.root
        assert not root.key and not root.slots and root.lock_ref == 0 and root.aux_slot is None
        seen: set[int] = set()
        aux_seen: set[int] = set()
        evictable = protected = 0
        stack = [root]
        while stack:
            node = stack.pop()
            for tok, child in node.children.items():
                assert child.key and child.key[0] == tok, f"child key mismatch at {child!r}"
                assert child.parent is node, f"bad parent link at {child!r}"
                assert len(child.slots) == len(child.key), f"slot/key length mismatch at {child!r}"
                assert child.lock_ref >= 0, f"negative lock_ref at {child!r}"
                if node is not root:
                    assert node.lock_ref >= child.lock_ref, f"child locked more than parent at {child!r}"
                for s in child.slots:
                    assert s not in seen, f"slot {s} appears twice in tree"
                    assert not self.allocator.is_free(s), f"tree slot {s} is free in allocator"
                    seen.add(s)
                if child.aux_slot is not None:
                    assert child.aux_slot not in aux_seen, f"aux slot {child.aux_slot} twice"
                    aux_seen.add(child.aux_slot)
                if child.lock_ref:
                    protected += len(child.slots)
                else:
                    evictable += len(child.slots)
                stack.append(child)
        assert evictable == self._evictable, f"evictable {self._evictable} != recomputed {evictable}"
        assert protected == self._protected, f"protected {self._protected} != recomputed {protected}"
        assert self.total_size == len(seen)
