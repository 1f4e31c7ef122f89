"""Tests for the radix prefix cache (runtime/scheduler/radix.py)."""

from __future__ import annotations

import random

import pytest

from runtime.scheduler.radix import RadixCache
from runtime.scheduler.slots import SlotAllocator


class RecordingAllocator(SlotAllocator):
    """SlotAllocator that records every free() call, in order."""

    def __init__(self, num_slots: int) -> None:
        super().__init__(num_slots)
        self.freed: list[list[int]] = []

    def free(self, slots: list[int]) -> None:
        self.freed.append(list(slots))
        super().free(slots)


@pytest.fixture
def alloc() -> RecordingAllocator:
    return RecordingAllocator(65)  # slots 1..64


@pytest.fixture
def aux_freed() -> list[int]:
    return []


@pytest.fixture
def tree(alloc: RecordingAllocator, aux_freed: list[int]):
    t = RadixCache(alloc, on_evict_aux=aux_freed.append)
    yield t
    t.check_invariants()
    alloc.check_invariants()


def put(tree: RadixCache, alloc: SlotAllocator, tokens: list[int], aux: int | None = None):
    """Allocate fresh slots for tokens and insert them; return (slots, result)."""
    slots = alloc.alloc(len(tokens))
    assert slots is not None
    return slots, tree.insert(tokens, slots, aux)


def test_match_empty_tree(tree: RadixCache) -> None:
    m = tree.match_prefix([1, 2, 3])
    assert m.slots == [] and m.node is tree.root and m.aux_slot is None and m.aux_len == 0
    assert tree.match_prefix([]).slots == []
    assert tree.total_size == tree.evictable_size == tree.protected_size == 0


def test_insert_then_full_and_partial_match(tree: RadixCache, alloc: RecordingAllocator) -> None:
    slots, r = put(tree, alloc, [10, 11, 12, 13])
    assert slots == [1, 2, 3, 4]
    assert (r.dup_len, r.aux_accepted, r.duplicate_slots) == (0, False, [])
    assert tree.total_size == tree.evictable_size == 4
    assert tree.match_prefix([10, 11, 12, 13]).slots == [1, 2, 3, 4]
    assert tree.match_prefix([10, 11, 12, 13, 14, 15]).slots == [1, 2, 3, 4]
    assert tree.match_prefix([11, 12]).slots == []
    tree.check_invariants()


def test_split_on_match(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [10, 11, 12, 13])
    m = tree.match_prefix([10, 11, 99])
    assert m.slots == [1, 2]
    assert m.node.key == [10, 11] and m.node.slots == [1, 2]
    (child,) = m.node.children.values()
    assert child.key == [12, 13] and child.slots == [3, 4] and child.parent is m.node
    assert tree.root.children[10] is m.node
    assert tree.total_size == 4  # a split moves slots, never adds any
    # The match ending exactly at the split point returns the same node.
    assert tree.match_prefix([10, 11]).node is m.node
    tree.check_invariants()


def test_split_on_insert_and_dup_len(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [10, 11, 12, 13])  # slots 1..4
    slots, r = put(tree, alloc, [10, 11, 20, 21, 22])  # caller computed 5..9
    assert slots == [5, 6, 7, 8, 9]
    assert r.dup_len == 2
    assert r.duplicate_slots == [5, 6]  # caller's copies of the cached prefix: caller frees
    alloc.free(r.duplicate_slots)
    # The tree kept its own slots for the shared prefix and took slots[dup_len:].
    assert tree.match_prefix([10, 11, 20, 21, 22]).slots == [1, 2, 7, 8, 9]
    assert tree.match_prefix([10, 11, 12, 13]).slots == [1, 2, 3, 4]
    upper = tree.root.children[10]
    assert upper.key == [10, 11] and sorted(upper.children) == [12, 20]
    assert tree.total_size == 7 and alloc.free_count == 64 - 7
    tree.check_invariants()


def test_insert_with_matched_prefix_has_no_duplicates(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3])  # slots 1..3
    m = tree.match_prefix([1, 2, 3, 4, 5])
    extra = alloc.alloc(2)
    assert extra == [4, 5]
    r = tree.insert([1, 2, 3, 4, 5], m.slots + extra)
    assert (r.dup_len, r.duplicate_slots) == (3, [])  # shared slots are the tree's own
    assert tree.match_prefix([1, 2, 3, 4, 5]).slots == [1, 2, 3, 4, 5]
    # Re-inserting an already-cached sequence: everything is a duplicate.
    r = tree.insert([1, 2], [1, 2])
    assert (r.dup_len, r.duplicate_slots) == (2, [])
    assert tree.total_size == 5


def test_insert_reports_the_node_and_slots_a_match_would(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3, 4])  # slots 1..4
    extra = alloc.alloc(2)
    # The caller's own slots for the shared part are duplicates; the tree's are reported.
    r = tree.insert([1, 2, 9, 9], [7, 8] + extra)
    m = tree.match_prefix([1, 2, 9, 9])
    assert r.node is m.node and r.tree_slots == m.slots == [1, 2] + extra
    assert r.duplicate_slots == [7, 8]
    r = tree.insert([1, 2], [1, 2])  # ends inside an edge: the edge is split there
    assert r.node is tree.match_prefix([1, 2]).node and r.tree_slots == [1, 2]
    tree.check_invariants()


def test_lock_unlock_sizes(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3, 4])
    put(tree, alloc, [1, 2, 7])
    # Tree: [1,2] -> {[3,4], [7]}
    m = tree.match_prefix([1, 2, 3, 4])
    tree.lock(m.node)
    assert (tree.evictable_size, tree.protected_size) == (1, 4)
    tree.lock(m.node)  # reference counted
    n = tree.match_prefix([1, 2, 7])
    tree.lock(n.node)
    assert (tree.evictable_size, tree.protected_size) == (0, 5)
    assert tree.root.children[1].lock_ref == 3
    tree.check_invariants()
    tree.unlock(m.node)
    assert (tree.evictable_size, tree.protected_size) == (0, 5)
    tree.unlock(m.node)
    assert (tree.evictable_size, tree.protected_size) == (2, 3)
    tree.unlock(n.node)
    assert (tree.evictable_size, tree.protected_size) == (5, 0)
    with pytest.raises(AssertionError):
        tree.unlock(n.node)


def test_split_of_locked_node_keeps_lock_accounting(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3, 4])
    m = tree.match_prefix([1, 2, 3, 4])
    tree.lock(m.node)
    put(tree, alloc, [1, 2, 9])  # splits the locked node
    assert (tree.evictable_size, tree.protected_size) == (1, 4)
    tree.check_invariants()
    tree.unlock(m.node)  # the held node still covers [1,2,3,4]
    assert (tree.evictable_size, tree.protected_size) == (5, 0)


def test_evict_lru_order(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 1])  # slots 1,2
    put(tree, alloc, [2, 2, 2])  # slots 3,4,5
    put(tree, alloc, [3])  # slot 6
    for toks in ([2, 2, 2], [3], [1, 1]):  # LRU order: [2,2,2] < [3] < [1,1]
        tree.match_prefix(toks)
    alloc.freed.clear()
    assert tree.evict(1) == 3
    assert alloc.freed == [[3, 4, 5]]
    assert tree.evict(2) == 3  # needs two nodes: [3] then [1,1]
    assert alloc.freed == [[3, 4, 5], [6], [1, 2]]
    assert tree.total_size == 0 and alloc.free_count == 64
    assert tree.evict(5) == 0
    assert tree.evict(0) == 0


def test_locked_nodes_never_evicted(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3])  # 1..3
    put(tree, alloc, [1, 2, 4])  # 4..6, dup 4,5
    alloc.free([4, 5])
    put(tree, alloc, [5, 5])  # 4,5
    m = tree.match_prefix([1, 2, 3])
    tree.lock(m.node)
    alloc.freed.clear()
    assert tree.evict(100) == 3
    assert alloc.freed == [[6], [4, 5]]  # [1,2,4] touched before [5,5]
    assert tree.match_prefix([1, 2, 3]).slots == [1, 2, 3]
    assert (tree.evictable_size, tree.protected_size) == (0, 3)
    tree.unlock(m.node)
    assert tree.evict(100) == 3
    assert alloc.freed[-2:] == [[3], [1, 2]]  # the split left two nodes; leaf goes first
    assert tree.total_size == 0


def test_evict_cascades_to_parent(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3, 4])  # 1..4
    _, r = put(tree, alloc, [1, 2, 5, 6])  # 5..8, dup 5,6
    alloc.free(r.duplicate_slots)
    put(tree, alloc, [9, 9])  # 5,6
    # Tree: [1,2] -> {[3,4], [5,6]->slots 7,8}; [9,9]. Touch order:
    tree.match_prefix([1, 2, 5, 6])
    tree.match_prefix([9, 9])
    tree.match_prefix([1, 2, 3, 4])  # [1,2] now newest, together with [3,4]
    alloc.freed.clear()
    assert tree.evict(100) == 8
    # [5,6] oldest, then [9,9], then [3,4]; [1,2] only becomes a leaf (candidate) after that.
    assert alloc.freed == [[7, 8], [5, 6], [3, 4], [1, 2]]
    assert tree.root.children == {}


def test_evict_stops_once_enough(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3, 4])
    _, r = put(tree, alloc, [1, 2, 5, 6])
    alloc.free(r.duplicate_slots)
    tree.match_prefix([1, 2, 3, 4])
    alloc.freed.clear()
    assert tree.evict(2) == 2
    assert alloc.freed == [[7, 8]]  # [1,2] still has a child, so it stays
    assert tree.match_prefix([1, 2, 3, 4]).slots == [1, 2, 3, 4]


def test_aux_slots(tree: RadixCache, alloc: RecordingAllocator, aux_freed: list[int]) -> None:
    _, r = put(tree, alloc, [1, 2, 3, 4], aux=100)  # slots 1..4
    assert r.aux_accepted
    # Aux at the end of a shorter prefix: insert splits the node.
    r = tree.insert([1, 2], [1, 2], aux_slot=101)
    assert (r.dup_len, r.aux_accepted) == (2, True)
    m = tree.match_prefix([1, 2, 3])
    assert (m.slots, m.aux_slot, m.aux_len) == ([1, 2, 3], 101, 2)  # [3] splits [3,4] with no aux
    m = tree.match_prefix([1, 2, 3, 4, 5])
    assert (m.aux_slot, m.aux_len) == (100, 4)  # the aux stayed on the lower half
    # A second aux for the same node is refused: the caller keeps and frees it.
    r = tree.insert([1, 2, 3, 4], [1, 2, 3, 4], aux_slot=102)
    assert not r.aux_accepted
    assert tree.insert([1, 2, 3, 4], [1, 2, 3, 4], aux_slot=100).aux_accepted  # already owned
    assert not tree.insert([], [], aux_slot=103).aux_accepted
    assert tree.owned_aux_slots() == {100, 101}
    tree.check_invariants()
    # Evicting nodes reports their aux slots, leaves first.
    assert tree.evict(1) == 1  # leaf [4] (aux 100)
    assert aux_freed == [100]
    m = tree.match_prefix([1, 2, 3, 4])
    assert (m.slots, m.aux_slot, m.aux_len) == ([1, 2, 3], 101, 2)
    tree.evict(100)
    assert aux_freed == [100, 101]
    assert tree.owned_aux_slots() == set()


def test_reset_frees_everything(tree: RadixCache, alloc: RecordingAllocator, aux_freed: list[int]) -> None:
    put(tree, alloc, [1, 2, 3], aux=7)
    _, r = put(tree, alloc, [1, 2, 4], aux=8)
    alloc.free(r.duplicate_slots)
    tree.lock(tree.match_prefix([1, 2, 3]).node)  # reset ignores locks (worker restart)
    assert tree.owned_slots() == {1, 2, 3, 6}
    tree.reset()
    assert alloc.free_count == alloc.capacity
    assert sorted(aux_freed) == [7, 8]
    assert tree.total_size == 0 and tree.root.children == {}
    assert tree.match_prefix([1, 2, 3]).slots == []


def test_check_invariants_catches_corruption(tree: RadixCache, alloc: RecordingAllocator) -> None:
    put(tree, alloc, [1, 2, 3])
    alloc.free([2])  # tree slot wrongly freed behind the tree's back
    with pytest.raises(AssertionError):
        tree.check_invariants()
    alloc.alloc(alloc.free_count)  # take it back so the fixture teardown passes


def test_randomized_conservation() -> None:
    """Random insert/match/lock/unlock/evict traffic; no slot is ever lost or doubled."""
    rng = random.Random(1234)
    alloc = SlotAllocator(49)  # 48 slots: small, so eviction pressure is constant
    aux_pool = SlotAllocator(9, reserve_zero=False)
    tree = RadixCache(alloc, on_evict_aux=lambda a: aux_pool.free([a]))
    bases = [[rng.randrange(5) for _ in range(8)] for _ in range(3)]
    # Simulated request: tokens, slots (len == len(tokens)), own = how many trailing
    # slots it owns, node = the tree node it has locked.
    reqs: list[dict] = []

    def alloc_or_evict(n: int) -> list[int] | None:
        got = alloc.alloc(n)
        if got is None:
            tree.evict(n - alloc.free_count)
            got = alloc.alloc(n)
        return got

    def start() -> None:
        base = rng.choice(bases)
        tokens = base[: rng.randrange(len(base) + 1)] + [rng.randrange(5) for _ in range(rng.randrange(4))]
        if not tokens:
            return
        m = tree.match_prefix(tokens)
        tree.lock(m.node)  # before allocating: allocating may evict
        extra = alloc_or_evict(len(tokens) - len(m.slots))
        if extra is None:
            tree.unlock(m.node)
            return
        reqs.append({"tokens": tokens, "slots": m.slots + extra, "own": len(extra), "node": m.node})

    def decode(req: dict) -> None:
        got = alloc_or_evict(1)
        if got is not None:
            req["tokens"].append(rng.randrange(5))
            req["slots"] += got
            req["own"] += 1

    def cache(req: dict, finished: bool) -> None:
        tokens, slots = req["tokens"], req["slots"]
        aux = aux_pool.alloc(1) if rng.random() < 0.5 else None
        r = tree.insert(tokens, slots, aux[0] if aux else None)
        if aux and not r.aux_accepted:
            aux_pool.free(aux)
        alloc.free(r.duplicate_slots)
        tree.unlock(req["node"])
        if finished:
            reqs.remove(req)
            return
        # Unfinished: swap in the tree's slots and lock the new path.
        m = tree.match_prefix(tokens)
        assert len(m.slots) == len(tokens)
        tree.lock(m.node)
        req.update(slots=m.slots, own=0, node=m.node)

    for _ in range(300):
        op = rng.random()
        if op < 0.3 or not reqs:
            start()
        elif op < 0.45:
            decode(rng.choice(reqs))
        elif op < 0.6:
            cache(rng.choice(reqs), finished=False)
        elif op < 0.85:
            cache(rng.choice(reqs), finished=True)
        elif op < 0.95:
            tree.evict(rng.randrange(1, 10))
        else:
            tree.match_prefix(rng.choice(bases)[: rng.randrange(9)])
        tree.check_invariants()
        alloc.check_invariants()
        held = [s for q in reqs for s in q["slots"][len(q["slots"]) - q["own"]:]]
        assert alloc.free_count + tree.total_size + len(held) == alloc.capacity
        assert len(set(held)) == len(held) and not set(held) & tree.owned_slots()
        assert aux_pool.free_count + len(tree.owned_aux_slots()) == aux_pool.capacity
        # Every request's shared prefix is still cached (locks held it).
        for q in reqs:
            shared = len(q["slots"]) - q["own"]
            assert tree.match_prefix(q["tokens"]).slots[:shared] == q["slots"][:shared]
    for q in reqs:
        tree.unlock(q["node"])
        alloc.free(q["slots"][len(q["slots"]) - q["own"]:])
    assert tree.protected_size == 0
    tree.reset()
    assert alloc.free_count == alloc.capacity and aux_pool.free_count == aux_pool.capacity
