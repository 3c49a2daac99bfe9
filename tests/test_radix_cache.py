from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    Bundle,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from radixlora.sched import radix_cache
from radixlora.sched.radix_cache import RadixCache

NS_A = (("base", "sha-base"), ("adapters", (("sha-legal", 1.0),)), ("salt", ""))
NS_B = (("base", "sha-base"), ("adapters", (("sha-medical", 1.0),)), ("salt", ""))


@dataclass(frozen=True)
class CollidingNamespace:
    """Distinct values with one forced hash: only full-key equality may tell them apart."""

    name: str

    def __hash__(self) -> int:
        return 42


class FreeLog:
    def __init__(self) -> None:
        self.slots: list[int] = []

    def __call__(self, slots: np.ndarray) -> None:
        assert slots.dtype == np.int32
        self.slots.extend(slots.tolist())


def slots(start: int, n: int) -> np.ndarray:
    return np.arange(start, start + n, dtype=np.int32)


def assert_sizes_exact(cache: RadixCache) -> None:
    owned = cache.all_slots()
    assert len(owned) == len(set(owned.tolist()))
    assert cache.evictable_size() + cache.protected_size() == cache.total_size() == len(owned)


# ---- unit tests ----------------------------------------------------------------------------


def test_empty_cache_matches_nothing():
    cache = RadixCache()
    result = cache.match_prefix(NS_A, [1, 2, 3])
    assert result.kv_slots.dtype == np.int32 and len(result.kv_slots) == 0
    cache.inc_lock_ref(result.last_node)
    cache.dec_lock_ref(result.last_node)
    assert cache.total_size() == 0


def test_insert_match_and_split():
    cache = RadixCache()
    assert cache.insert(NS_A, [1, 2, 3, 4], slots(10, 4)) == 0
    assert cache.match_prefix(NS_A, [1, 2, 3, 4, 5]).kv_slots.tolist() == [10, 11, 12, 13]
    partial = cache.match_prefix(NS_A, [1, 2, 9])
    assert partial.kv_slots.tolist() == [10, 11]
    assert partial.last_node.key.tolist() == [1, 2]
    assert cache.match_prefix(NS_A, [1, 2, 3, 4]).kv_slots.tolist() == [10, 11, 12, 13]
    assert cache.insert(NS_A, [1, 2, 7, 8], slots(20, 4)) == 2
    assert cache.match_prefix(NS_A, [1, 2, 7, 8]).kv_slots.tolist() == [10, 11, 22, 23]
    assert sorted(cache.all_slots().tolist()) == [10, 11, 12, 13, 22, 23]
    assert_sizes_exact(cache)


def test_numpy_tokens_are_copied():
    cache = RadixCache()
    tokens = np.array([5, 6, 7], dtype=np.int32)
    kv_slots = slots(0, 3)
    cache.insert(NS_A, tokens, kv_slots)
    tokens[:] = 0
    kv_slots[:] = 99
    assert cache.match_prefix(NS_A, np.array([5, 6, 7])).kv_slots.tolist() == [0, 1, 2]


def test_namespaces_never_share():
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3], slots(0, 3))
    assert len(cache.match_prefix(NS_B, [1, 2, 3]).kv_slots) == 0
    assert cache.insert(NS_B, [1, 2, 3], slots(3, 3)) == 0
    assert cache.match_prefix(NS_A, [1, 2, 3]).kv_slots.tolist() == [0, 1, 2]
    assert cache.match_prefix(NS_B, [1, 2, 3]).kv_slots.tolist() == [3, 4, 5]
    assert cache.total_size() == 6


def test_colliding_hashes_never_share():
    first, second = CollidingNamespace("legal"), CollidingNamespace("medical")
    assert hash(first) == hash(second) and first != second
    cache = RadixCache()
    cache.insert(first, [1, 2, 3], slots(0, 3))
    assert len(cache.match_prefix(second, [1, 2, 3]).kv_slots) == 0
    assert cache.insert(second, [1, 2, 3], slots(3, 3)) == 0
    assert cache.match_prefix(CollidingNamespace("legal"), [1, 2, 3]).kv_slots.tolist() == [0, 1, 2]
    assert cache.match_prefix(second, [1, 2, 3]).kv_slots.tolist() == [3, 4, 5]


@pytest.mark.parametrize("page_size", [1, 4])
def test_page_alignment(page_size):
    cache = RadixCache(page_size)
    tokens = list(range(10))
    aligned = 10 - 10 % page_size
    assert cache.insert(NS_A, tokens, slots(0, 10)) == 0
    assert sorted(cache.all_slots().tolist()) == list(range(aligned))
    assert len(cache.match_prefix(NS_A, tokens[:7]).kv_slots) == 7 - 7 % page_size
    diverging = tokens[:5] + [99, 99, 99]
    assert len(cache.match_prefix(NS_A, diverging).kv_slots) == 5 - 5 % page_size
    assert_sizes_exact(cache)


def test_short_insert_is_ignored_with_pages():
    cache = RadixCache(page_size=4)
    assert cache.insert(NS_A, [1, 2, 3], slots(0, 3)) == 0
    assert cache.total_size() == 0 and cache.namespaces() == []


def test_insert_returns_existing_prefix_and_keeps_first_slots():
    cache = RadixCache()
    assert cache.insert(NS_A, [1, 2, 3, 4], slots(0, 4)) == 0
    assert cache.insert(NS_A, [1, 2, 3, 4], slots(10, 4)) == 4
    assert cache.insert(NS_A, [1, 2], slots(20, 2)) == 2
    assert cache.insert(NS_A, [1, 2, 3, 4, 5, 6], slots(30, 6)) == 4
    assert cache.match_prefix(NS_A, [1, 2, 3, 4, 5, 6]).kv_slots.tolist() == [0, 1, 2, 3, 34, 35]
    assert sorted(cache.all_slots().tolist()) == [0, 1, 2, 3, 34, 35]


def test_lock_prevents_eviction_and_sizes_stay_exact():
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3, 4], slots(0, 4))
    cache.insert(NS_A, [1, 2, 5, 6], slots(4, 4))
    locked = cache.match_prefix(NS_A, [1, 2, 3, 4]).last_node
    cache.inc_lock_ref(locked)
    assert (cache.protected_size(), cache.evictable_size()) == (4, 2)
    free_log = FreeLog()
    assert cache.evict(100, free_log) == 2
    assert free_log.slots == [6, 7]
    assert cache.match_prefix(NS_A, [1, 2, 3, 4]).kv_slots.tolist() == [0, 1, 2, 3]
    assert_sizes_exact(cache)
    cache.dec_lock_ref(locked)
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)
    assert cache.evict(100, free_log) == 4
    assert sorted(free_log.slots) == [0, 1, 2, 3, 6, 7] and cache.namespaces() == []


def test_unbalanced_dec_lock_ref_raises():
    cache = RadixCache()
    cache.insert(NS_A, [1, 2], slots(0, 2))
    node = cache.match_prefix(NS_A, [1, 2]).last_node
    cache.inc_lock_ref(node)
    cache.dec_lock_ref(node)
    with pytest.raises(RuntimeError):
        cache.dec_lock_ref(node)
    assert cache.evictable_size() == 2


def test_lock_on_evicted_node_raises():
    cache = RadixCache()
    cache.insert(NS_A, [1, 2], slots(0, 2))
    node = cache.match_prefix(NS_A, [1, 2]).last_node
    cache.evict(2, FreeLog())
    with pytest.raises(RuntimeError):
        cache.inc_lock_ref(node)


def test_evict_is_lru_and_parents_become_leaves():
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3], slots(0, 3))
    cache.insert(NS_A, [1, 2, 4], slots(3, 3))
    cache.insert(NS_B, [7, 8], slots(6, 2))
    cache.match_prefix(NS_A, [1, 2, 3])
    free_log = FreeLog()
    assert cache.evict(1, free_log) == 1
    assert free_log.slots == [5]
    assert cache.evict(2, free_log) == 2
    assert free_log.slots == [5, 6, 7]
    assert cache.namespaces() == [NS_A]
    assert cache.evict(2, free_log) == 3
    assert free_log.slots == [5, 6, 7, 2, 0, 1]
    assert cache.namespaces() == [] and cache.total_size() == 0


def test_eviction_never_walks_the_tree(monkeypatch):
    """Evicting costs what it evicts: no call walks the tree, whatever inserts, touches and
    unlocks came between (each new evictable leaf is pushed when it becomes one)."""
    walks = []
    walk = radix_cache._iter_subtrees
    monkeypatch.setattr(radix_cache, "_iter_subtrees",
                        lambda starts: walks.append(1) or walk(starts))
    cache = RadixCache()
    for i in range(6):
        cache.insert(NS_A, [i, 1, 2], slots(3 * i, 3))
    free_log = FreeLog()
    cache.evict(3, free_log)
    cache.match_prefix(NS_A, [1, 1, 2])  # touched: re-keyed when popped
    cache.evict(3, free_log)
    cache.evict(3, free_log)
    assert free_log.slots == [0, 1, 2, 6, 7, 8, 9, 10, 11]
    cache.insert(NS_A, [9, 9, 9], slots(30, 3))
    locked = cache.match_prefix(NS_A, [4, 1, 2]).last_node
    cache.inc_lock_ref(locked)
    cache.evict(3, free_log)
    cache.dec_lock_ref(locked)
    cache.evict(6, free_log)
    assert free_log.slots[-9:] == [15, 16, 17, 3, 4, 5, 30, 31, 32] and not walks


def test_eviction_in_a_full_cache_pops_what_it_evicts(monkeypatch):
    """Thousands of cached prompts, each step finishing a request (insert, unlock) and
    evicting a prompt for a new one: an eviction pops a few heap entries and walks nothing."""
    cache, free_log = RadixCache(), FreeLog()
    for i in range(2000):
        node = _insert_locked(cache, i, 10 * i)
        cache.dec_lock_ref(node)
    work = []  # one entry per heap pop and per node walked
    pop, walk = radix_cache.heapq.heappop, radix_cache._iter_subtrees
    monkeypatch.setattr(radix_cache.heapq, "heappop", lambda heap: work.append(1) or pop(heap))
    monkeypatch.setattr(radix_cache, "_iter_subtrees",
                        lambda starts: (work.append(1) or n for n in walk(starts)))
    for i in range(2000, 2200):
        cache.dec_lock_ref(_insert_locked(cache, i, 10 * i))
        before = len(work)
        assert cache.evict(4, free_log) == 4
        assert len(work) - before <= 3


def test_candidate_heap_stays_bounded_without_evictions():
    """Every unlock pushes an entry; with nothing evicted the stale ones are compacted."""
    cache = RadixCache()
    node = _insert_locked(cache, 0, 0)
    for _ in range(5000):
        cache.dec_lock_ref(node)
        cache.inc_lock_ref(node)
    assert len(cache._candidates) <= 2 * cache.total_size() + 1024
    cache.dec_lock_ref(node)
    free_log = FreeLog()
    assert cache.evict(4, free_log) == 4 and free_log.slots == [0, 1, 2, 3]


def _insert_locked(cache: RadixCache, i: int, first_slot: int):
    tokens = [i, 7, 7, 7]
    cache.insert(NS_A, tokens, slots(first_slot, 4))
    node = cache.match_prefix(NS_A, tokens).last_node
    cache.inc_lock_ref(node)
    return node


def lru_eviction_oracle(cache: RadixCache, num_tokens: int) -> list[int]:
    """The slots an eviction of num_tokens must free, in order, found the slow way: rescan the
    whole tree for the least recently used unlocked leaf before every pick (ties: the lower
    node_id). Reads the tree's private root; nothing is kept between calls."""
    stack, nodes = [cache._root], []
    while stack:
        nodes.append(stack.pop())
        stack.extend(nodes[-1].children.values())
    children = {id(n): {id(c) for c in n.children.values()} for n in nodes}
    parent = {id(c): id(n) for n in nodes for c in n.children.values()}
    freed: list[int] = []
    while len(freed) < num_tokens:
        leaves = [n for n in nodes if id(n) in children and not children[id(n)]
                  and n.lock_ref == 0 and n.num_tokens > 0]
        if not leaves:
            break
        leaf = min(leaves, key=lambda n: (n.last_access, n.node_id))
        freed += leaf.kv_slots.tolist()
        del children[id(leaf)]
        children[parent[id(leaf)]].discard(id(leaf))
    return freed


def test_drop_namespaces_frees_unlocked():
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3], slots(0, 3))
    cache.insert(NS_B, [1, 2, 3], slots(3, 3))
    free_log = FreeLog()
    assert cache.drop_namespaces(lambda ns: ns == NS_A, free_log) == 3
    assert sorted(free_log.slots) == [0, 1, 2]
    assert cache.namespaces() == [NS_B]
    assert len(cache.match_prefix(NS_A, [1, 2, 3]).kv_slots) == 0
    assert_sizes_exact(cache)


def test_drop_namespace_with_lock_frees_on_unlock():
    cache = RadixCache()
    cache.insert(NS_A, [1, 2, 3, 4], slots(0, 4))
    cache.insert(NS_A, [1, 2, 5, 6], slots(4, 4))
    locked = cache.match_prefix(NS_A, [1, 2, 3, 4]).last_node
    cache.inc_lock_ref(locked)
    cache.inc_lock_ref(locked)
    free_log = FreeLog()
    assert cache.drop_namespaces(lambda ns: ns == NS_A, free_log) == 2
    assert sorted(free_log.slots) == [6, 7]
    assert cache.namespaces() == []
    assert len(cache.match_prefix(NS_A, [1, 2, 3, 4]).kv_slots) == 0
    assert cache.insert(NS_A, [1, 2, 3, 4], slots(10, 4)) == 0
    assert sorted(cache.all_slots().tolist()) == [0, 1, 2, 3, 10, 11, 12, 13]
    assert cache.protected_size() == 4
    assert_sizes_exact(cache)
    cache.dec_lock_ref(locked)
    assert len(free_log.slots) == 2
    cache.dec_lock_ref(locked)
    assert sorted(free_log.slots) == [0, 1, 2, 3, 6, 7]
    assert sorted(cache.all_slots().tolist()) == [10, 11, 12, 13]
    assert (cache.protected_size(), cache.evictable_size()) == (0, 4)


def test_namespace_stats_and_reset():
    cache = RadixCache(page_size=2)
    cache.insert(NS_A, [1, 2, 3, 4], slots(0, 4))
    cache.match_prefix(NS_A, [1, 2, 3, 9, 9])
    cache.match_prefix(NS_B, [1, 2])
    cache.match_prefix(NS_A, [1, 2], record_stats=False)
    assert cache.namespace_stats() == {NS_A: (2, 5), NS_B: (0, 2)}
    cache.reset()
    assert cache.namespace_stats() == {} and cache.total_size() == 0
    assert len(cache.all_slots()) == 0


def test_bad_arguments():
    with pytest.raises(ValueError):
        RadixCache(page_size=0)
    with pytest.raises(ValueError):
        RadixCache().insert(NS_A, [1, 2], slots(0, 3))


# ---- stateful test against a dict model ----------------------------------------------------

NAMESPACES = [NS_A, CollidingNamespace("x"), CollidingNamespace("y")]
namespaces = st.sampled_from(NAMESPACES)
token_lists = st.lists(st.integers(0, 2), max_size=12)
insert_token_lists = st.lists(st.integers(0, 2), min_size=3, max_size=12)
cuts = st.integers(1, 12)


@dataclass
class HeldLock:
    namespace: object
    node: object
    kv_slots: frozenset[int]
    dropped: bool = False


@dataclass
class Model:
    """(namespace, tokens up to a page end) -> that page's slots; prefix-closed by pages."""

    page_size: int
    pages: dict[tuple[object, tuple[int, ...]], tuple[int, ...]] = field(default_factory=dict)
    key_of_slot: dict[int, tuple[object, tuple[int, ...]]] = field(default_factory=dict)

    def cached_len(self, namespace, tokens: list[int]) -> int:
        n = 0
        while n + self.page_size <= len(tokens):
            if (namespace, tuple(tokens[: n + self.page_size])) not in self.pages:
                break
            n += self.page_size
        return n

    def slots_for(self, namespace, tokens: list[int]) -> list[int]:
        ends = range(self.page_size, len(tokens) + 1, self.page_size)
        return [slot for end in ends for slot in self.pages[(namespace, tuple(tokens[:end]))]]

    def add(self, namespace, tokens: list[int], kv_slots: list[int], start: int) -> None:
        for end in range(start + self.page_size, len(tokens) + 1, self.page_size):
            key = (namespace, tuple(tokens[:end]))
            self.pages[key] = tuple(kv_slots[end - self.page_size : end])
            self.key_of_slot.update(dict.fromkeys(self.pages[key], key))

    def owned(self) -> set[int]:
        return {slot for page in self.pages.values() for slot in page}

    def remove_slot(self, slot: int) -> None:
        """Eviction frees whole pages: the page goes with its first freed slot."""
        self.pages.pop(self.key_of_slot.pop(slot), None)

    def pop_namespace(self, namespace) -> set[int]:
        removed = {slot for (ns, _), page in self.pages.items() if ns == namespace for slot in page}
        for slot in removed:
            self.remove_slot(slot)
        return removed


class RadixCacheMachine(RuleBasedStateMachine):
    inserted = Bundle("inserted")

    @initialize(page_size=st.sampled_from([1, 2, 4]))
    def setup(self, page_size):
        self.page_size = page_size
        self.cache = RadixCache(page_size)
        self.model = Model(page_size)
        self.num_allocated = 0
        self.freed_by_cache: set[int] = set()
        self.freed_by_caller: set[int] = set()
        self.pending: set[int] = set()
        self.held: list[HeldLock] = []
        self.stats: dict[object, tuple[int, int]] = {}

    def allocate(self, n: int) -> list[int]:
        start, self.num_allocated = self.num_allocated, self.num_allocated + n
        return list(range(start, start + n))

    def caller_free(self, kv_slots: list[int]) -> None:
        assert not self.freed_by_caller.intersection(kv_slots)
        self.freed_by_caller.update(kv_slots)

    def on_evict(self, kv_slots: np.ndarray) -> None:
        for slot in kv_slots.tolist():
            assert slot not in self.freed_by_cache
            self.model.remove_slot(slot)
            self.freed_by_cache.add(slot)

    def on_drop_free(self, kv_slots: np.ndarray) -> None:
        for slot in kv_slots.tolist():
            self.pending.remove(slot)
            self.freed_by_cache.add(slot)

    def aligned(self, n: int) -> int:
        return n - n % self.page_size

    def checked_match(self, namespace, tokens):
        result = self.cache.match_prefix(namespace, tokens)
        expected = self.model.cached_len(namespace, tokens[: self.aligned(len(tokens))])
        assert len(result.kv_slots) == expected
        assert result.kv_slots.tolist() == self.model.slots_for(namespace, tokens[:expected])
        hit, lookup = self.stats.get(namespace, (0, 0))
        self.stats[namespace] = (hit + expected, lookup + len(tokens))
        return result

    def checked_insert(self, namespace, tokens, kv_slots, matched: int) -> None:
        end = self.aligned(len(tokens))
        expected = self.model.cached_len(namespace, tokens[:end])
        assert self.cache.insert(namespace, tokens, np.array(kv_slots, dtype=np.int32)) == expected
        self.model.add(namespace, tokens[:end], kv_slots, expected)
        self.caller_free(kv_slots[matched:expected] + kv_slots[end:])

    @rule(target=inserted, namespace=namespaces, tokens=insert_token_lists)
    def insert_fresh(self, namespace, tokens):
        kv_slots = self.allocate(len(tokens))
        self.checked_insert(namespace, tokens, kv_slots, matched=0)
        return namespace, tokens

    @rule(target=inserted, namespace=namespaces, tokens=insert_token_lists)
    def match_then_insert(self, namespace, tokens):
        prefix = self.checked_match(namespace, tokens).kv_slots.tolist()
        kv_slots = prefix + self.allocate(len(tokens) - len(prefix))
        self.checked_insert(namespace, tokens, kv_slots, matched=len(prefix))
        return namespace, tokens

    @rule(namespace=namespaces, tokens=token_lists)
    def match(self, namespace, tokens):
        self.checked_match(namespace, tokens)

    @rule(entry=inserted, cut=cuts, extra=token_lists)
    def match_inserted(self, entry, cut, extra):
        namespace, tokens = entry
        self.checked_match(namespace, tokens[:cut] + extra)

    @rule(namespace=namespaces, tokens=token_lists)
    def lock(self, namespace, tokens):
        self.match_and_lock(namespace, tokens)

    @rule(entry=inserted, cut=cuts)
    def lock_inserted(self, entry, cut):
        namespace, tokens = entry
        self.match_and_lock(namespace, tokens[:cut])

    def match_and_lock(self, namespace, tokens):
        result = self.checked_match(namespace, tokens)
        self.cache.inc_lock_ref(result.last_node)
        held_slots = frozenset(result.kv_slots.tolist())
        self.held.append(HeldLock(namespace, result.last_node, held_slots))

    @precondition(lambda self: self.held)
    @rule(index=st.integers(0, 50))
    def unlock(self, index):
        held = self.held.pop(index % len(self.held))
        self.cache.dec_lock_ref(held.node)

    @rule(num_tokens=st.integers(0, 64))
    def evict(self, num_tokens):
        before = self.cache.evictable_size()
        num_freed_before = len(self.freed_by_cache)
        expected = lru_eviction_oracle(self.cache, num_tokens) if num_tokens > 0 else []
        evicted: list[int] = []
        num_freed = self.cache.evict(num_tokens, lambda s: (evicted.extend(s.tolist()),
                                                            self.on_evict(s)))
        assert evicted == expected
        assert num_freed == len(self.freed_by_cache) - num_freed_before
        assert num_freed >= num_tokens or self.cache.evictable_size() == 0
        assert self.cache.evictable_size() == before - num_freed

    @rule(namespace=namespaces)
    def drop(self, namespace):
        self.pending |= self.model.pop_namespace(namespace)
        for held in self.held:
            held.dropped = held.dropped or held.namespace == namespace
        num_freed_before = len(self.freed_by_cache)
        num_freed = self.cache.drop_namespaces(lambda ns: ns == namespace, self.on_drop_free)
        assert num_freed == len(self.freed_by_cache) - num_freed_before
        assert namespace not in self.cache.namespaces()

    @invariant()
    def sizes_and_ownership(self):
        owned = self.cache.all_slots().tolist()
        owned_set = set(owned)
        assert len(owned) == len(owned_set)
        assert self.cache.evictable_size() + self.cache.protected_size() == len(owned)
        assert self.cache.total_size() == len(owned)
        assert owned_set == self.model.owned() | self.pending
        assert not self.freed_by_cache & self.freed_by_caller
        assert not owned_set & (self.freed_by_cache | self.freed_by_caller)
        assert len(owned) + len(self.freed_by_cache | self.freed_by_caller) == self.num_allocated

    @invariant()
    def locks_protect_exactly_their_paths(self):
        locked = set().union(*(held.kv_slots for held in self.held))
        dropped = set().union(*(held.kv_slots for held in self.held if held.dropped))
        assert self.cache.protected_size() == len(locked)
        assert locked <= set(self.cache.all_slots().tolist())
        assert self.pending == dropped
        assert self.cache.namespace_stats() == self.stats

    def teardown(self):
        while self.held:
            self.cache.dec_lock_ref(self.held.pop().node)
        assert not self.pending
        everything = self.cache.total_size() + 1
        expected = lru_eviction_oracle(self.cache, everything)
        evicted: list[int] = []
        self.cache.evict(everything, lambda s: (evicted.extend(s.tolist()), self.on_evict(s)))
        assert evicted == expected
        assert self.cache.total_size() == 0 and len(self.cache.all_slots()) == 0
        assert self.cache.namespaces() == [] and not self.model.pages


RadixCacheMachine.TestCase.settings = settings(
    max_examples=200,
    stateful_step_count=40,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow],
)
test_radix_cache_state_machine = RadixCacheMachine.TestCase
