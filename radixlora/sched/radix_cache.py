"""Adapter-aware radix prefix cache: (namespace, tokens) -> KV slot ids, one subtree per namespace.

The root's children are one node per namespace (base version + canonical adapter set + salt),
held in a dict keyed by the namespace object itself. Python compares the full keys whenever two
hashes collide, so two namespaces share nodes only when they compare equal (docs/architecture.md,
"Cache key"). Below each namespace node is a compressed radix tree over token ids whose values
are KV slot ids, one per token. The cache owns slot ids only, never tensors: it hands slots back
to the caller's `free_fn`.

Invariants:
- a token node's `key` and `kv_slots` are int32 arrays of equal length, a positive multiple of
  `page_size`; namespace nodes and the root have empty keys;
- siblings differ in their first page, which is their key in `parent.children`;
- `lock_ref` of a node >= the sum over its children: a lock covers the whole path from the
  locked node up to its namespace node;
- `evictable_size() + protected_size() == total_size() == len(all_slots())`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable, Hashable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field

import numpy as np

FreeFn = Callable[[np.ndarray], None]

_node_ids = itertools.count()


def _empty_slots() -> np.ndarray:
    return np.empty(0, dtype=np.int32)


@dataclass(eq=False)
class TreeNode:
    key: np.ndarray
    kv_slots: np.ndarray
    parent: TreeNode | None = None
    children: dict[Hashable, TreeNode] = field(default_factory=dict)
    lock_ref: int = 0
    last_access: int = 0
    # Set on namespace nodes only.
    namespace: Hashable = None
    # Set when a dropped namespace still had locked nodes: dec_lock_ref frees through it.
    orphan_free_fn: FreeFn | None = None
    removed: bool = False
    node_id: int = field(default_factory=lambda: next(_node_ids))

    @property
    def num_tokens(self) -> int:
        return len(self.key)

    @property
    def is_namespace(self) -> bool:
        return self.parent is not None and self.parent.parent is None


@dataclass
class MatchResult:
    """`kv_slots`: the cached prefix's slots (int32, page aligned, a copy the caller may keep).
    `last_node`: the deepest matched node, the namespace node when no token matched, or the
    root when the namespace is not cached at all; pass it to inc_lock_ref / dec_lock_ref."""

    kv_slots: np.ndarray
    last_node: TreeNode

    @property
    def num_tokens(self) -> int:
        return len(self.kv_slots)


class RadixCache:
    """Prefix cache over (namespace, tokens); see the module docstring for the invariants."""

    def __init__(self, page_size: int = 1) -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.reset()

    def reset(self) -> None:
        """Forget every node, lock and statistic without calling any free_fn.

        Mutates: the whole cache. The caller resets its slot allocator alongside."""
        self._root = TreeNode(key=_empty_slots(), kv_slots=_empty_slots())
        self._orphans: list[TreeNode] = []
        self._evictable_size = 0
        self._protected_size = 0
        self._stats: dict[Hashable, list[int]] = {}
        self._clock = itertools.count(1)
        self._candidates: list[tuple[int, int, TreeNode]] = []  # see evict

    # ---- lookup and insert -------------------------------------------------------------

    def match_prefix(
        self, namespace: Hashable, tokens: Sequence[int] | np.ndarray, *, record_stats: bool = True
    ) -> MatchResult:
        """Longest cached page-aligned prefix of `tokens` under `namespace`.

        Mutates: splits the node the match ends inside (sizes unchanged); refreshes the
        last-access time of every node on the matched path; with `record_stats`, adds the
        matched and the looked-up token counts to the namespace's statistics."""
        tokens = _as_int32(tokens)
        ns_node = self._root.children.get(namespace)
        if ns_node is None:
            result = MatchResult(_empty_slots(), self._root)
        else:
            now = self._tick()
            ns_node.last_access = now
            last_node, pieces = self._match_path(ns_node, tokens[: self._aligned(len(tokens))], now)
            result = MatchResult(_concat(pieces), last_node)
        if record_stats:
            self._record_lookup(namespace, result.num_tokens, len(tokens))
        return result

    def insert(
        self,
        namespace: Hashable,
        tokens: Sequence[int] | np.ndarray,
        kv_slots: Sequence[int] | np.ndarray,
    ) -> int:
        """Cache the page-aligned part of `tokens` with `kv_slots` (one slot per token).

        Returns how many leading tokens were already cached. The tree keeps its own slots for
        those positions and takes ownership only of `kv_slots[returned:aligned_len]`; the caller
        still owns (and must free) its slots in `[0, returned)` that differ from the tree's,
        and the unaligned tail `[aligned_len, len)`.
        Mutates: adds at most one leaf (and the namespace node if new), may split one node,
        refreshes last-access times on the path; the new tokens count as evictable."""
        tokens, kv_slots = _as_int32(tokens), _as_int32(kv_slots)
        if len(tokens) != len(kv_slots):
            raise ValueError(f"{len(tokens)} tokens but {len(kv_slots)} kv_slots")
        end = self._aligned(len(tokens))
        if end == 0:
            return 0
        now = self._tick()
        node, pos = self._namespace_node(namespace, now), 0
        while pos < end:
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                self._add_leaf(node, tokens[pos:end], kv_slots[pos:end], now)
                return pos
            child.last_access = now
            matched = self._prefix_len(child.key, tokens[pos:end])
            pos += matched
            if matched < child.num_tokens:
                if pos == end:
                    return end
                child = self._split(child, matched)
            node = child
        return end

    # ---- locks -------------------------------------------------------------------------

    def inc_lock_ref(self, node: TreeNode) -> None:
        """Protect the path from `node` up to its namespace node from eviction.

        Mutates: `lock_ref` along the path; moves newly locked tokens from evictable to
        protected. A no-op for the root (nothing matched, nothing to protect)."""
        if node.removed:
            raise RuntimeError("inc_lock_ref on a node that is no longer cached")
        for path_node in _path_up(node):
            if path_node.lock_ref == 0:
                self._evictable_size -= path_node.num_tokens
                self._protected_size += path_node.num_tokens
            path_node.lock_ref += 1

    def dec_lock_ref(self, node: TreeNode) -> None:
        """Undo one inc_lock_ref(node).

        Mutates: `lock_ref` along the path; tokens whose lock reaches zero become evictable,
        or, in a namespace dropped while locked, are freed at once through the free_fn given
        to drop_namespaces. Raises RuntimeError (changing nothing) on an unbalanced call."""
        path = list(_path_up(node))
        if any(path_node.lock_ref <= 0 for path_node in path):
            raise RuntimeError("dec_lock_ref without a matching inc_lock_ref")
        released = []
        for path_node in path:
            path_node.lock_ref -= 1
            if path_node.lock_ref == 0:
                self._protected_size -= path_node.num_tokens
                self._evictable_size += path_node.num_tokens
                released.append(path_node)
        if path and path[-1].orphan_free_fn is not None:
            self._free_orphaned(released, path[-1])
            return
        for path_node in released:
            if path_node.children:
                continue
            if path_node.is_namespace:  # its tokens were evicted while it was locked
                self._unlink(path_node)
            else:
                self._push_candidate(path_node)

    # ---- eviction ----------------------------------------------------------------------

    def evict(self, num_tokens: int, free_fn: FreeFn) -> int:
        """Evict least-recently-used unlocked leaves until `num_tokens` are freed or nothing
        is evictable; a parent left without children becomes a candidate in turn.

        Cost: O(what it evicts), never a walk of the tree. The candidate heap holds an entry
        for every evictable leaf, pushed when it became one (inserted, unlocked, or left
        childless by an eviction) and keyed by its last access then: an entry is re-keyed when
        popped if the node was touched since, and dropped if the node was locked, given
        children or removed. Stale entries are compacted once they outnumber the nodes.

        Mutates: removes the evicted nodes and any unlocked namespace node left empty; calls
        `free_fn` once with all evicted slots (not at all when none). Returns tokens freed."""
        if num_tokens <= 0:
            return 0
        heap = self._candidates
        pieces: list[np.ndarray] = []
        num_freed = 0
        while heap and num_freed < num_tokens:
            last_access, _, leaf = heapq.heappop(heap)
            if leaf.removed or leaf.children or leaf.lock_ref > 0:
                continue
            if leaf.last_access != last_access:
                heapq.heappush(heap, (leaf.last_access, leaf.node_id, leaf))
                continue
            parent = leaf.parent
            pieces.append(leaf.kv_slots)
            num_freed += leaf.num_tokens
            self._evictable_size -= leaf.num_tokens
            self._unlink(leaf)
            if parent.children or parent.lock_ref > 0:
                continue
            if parent.is_namespace:
                self._unlink(parent)
            else:
                heapq.heappush(heap, (parent.last_access, parent.node_id, parent))
        _call_free(free_fn, pieces)
        return num_freed

    def _push_candidate(self, node: TreeNode) -> None:
        """An evictable leaf for evict's heap. When stale entries make the heap more than twice
        the nodes it can hold (at most one per page cached), rebuild it from the tree: a walk
        that at least as many pushes have paid for."""
        heap = self._candidates
        heapq.heappush(heap, (node.last_access, node.node_id, node))
        if len(heap) > 2 * (self.total_size() // self.page_size) + 1024:
            self._candidates = [(n.last_access, n.node_id, n) for n in self._evictable_leaves()]
            heapq.heapify(self._candidates)

    def drop_namespaces(self, predicate: Callable[[Hashable], bool], free_fn: FreeFn) -> int:
        """Remove every cached namespace for which `predicate(namespace)` is true.

        Unlocked nodes are freed now through `free_fn`. A namespace that still has locked
        nodes is detached from the root, so no new request can match it, and its locked nodes
        stay owned (counted as protected, listed by all_slots) until their lock drops to zero;
        dec_lock_ref then frees them through this `free_fn`. Statistics are kept (counters
        never go back). Mutates: the matching namespaces' subtrees and the sizes.
        Returns the tokens freed now."""
        pieces: list[np.ndarray] = []
        for namespace, ns_node in list(self._root.children.items()):
            if not predicate(namespace):
                continue
            del self._root.children[namespace]
            pieces.extend(self._free_unlocked_subtrees(ns_node))
            if ns_node.lock_ref > 0:
                ns_node.orphan_free_fn = free_fn
                self._orphans.append(ns_node)
            else:
                ns_node.removed = True
        _call_free(free_fn, pieces)
        return sum(len(piece) for piece in pieces)

    # ---- sizes and statistics ----------------------------------------------------------

    def total_size(self) -> int:
        return self._evictable_size + self._protected_size

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def namespaces(self) -> list[Hashable]:
        """Namespaces a new request can match now (dropped ones excluded)."""
        return list(self._root.children)

    def namespace_stats(self) -> dict[Hashable, tuple[int, int]]:
        """namespace -> (hit_tokens, lookup_tokens), cumulative since construction or reset."""
        return {namespace: (hit, lookup) for namespace, (hit, lookup) in self._stats.items()}

    def all_slots(self) -> np.ndarray:
        """Every slot the cache owns, including locked slots of dropped namespaces."""
        starts = [self._root, *self._orphans]
        return _concat([node.kv_slots for node in _iter_subtrees(starts)])

    # ---- helpers -----------------------------------------------------------------------

    def _tick(self) -> int:
        return next(self._clock)

    def _aligned(self, length: int) -> int:
        return length - length % self.page_size

    def _child_key(self, tokens: np.ndarray, pos: int) -> Hashable:
        if self.page_size == 1:
            return int(tokens[pos])
        return tuple(tokens[pos : pos + self.page_size].tolist())

    def _prefix_len(self, key: np.ndarray, tokens: np.ndarray) -> int:
        """Length of the common page-aligned prefix of `key` and `tokens`."""
        n = min(len(key), len(tokens))
        mismatches = np.flatnonzero(key[:n] != tokens[:n])
        return self._aligned(int(mismatches[0]) if mismatches.size else n)

    def _match_path(
        self, node: TreeNode, tokens: np.ndarray, now: int
    ) -> tuple[TreeNode, list[np.ndarray]]:
        pieces: list[np.ndarray] = []
        pos = 0
        while pos < len(tokens):
            child = node.children.get(self._child_key(tokens, pos))
            if child is None:
                break
            child.last_access = now
            matched = self._prefix_len(child.key, tokens[pos:])
            if matched < child.num_tokens:
                child = self._split(child, matched)
            pieces.append(child.kv_slots)
            pos += matched
            node = child
        return node, pieces

    def _split(self, node: TreeNode, length: int) -> TreeNode:
        """Cut `node` after `length` tokens; return the new upper node. `node` keeps its
        identity as the lower part, so callers holding it as `last_node` stay valid."""
        upper = TreeNode(
            key=node.key[:length],
            kv_slots=node.kv_slots[:length],
            parent=node.parent,
            lock_ref=node.lock_ref,
            last_access=node.last_access,
        )
        node.parent.children[self._child_key(upper.key, 0)] = upper
        node.key, node.kv_slots, node.parent = node.key[length:], node.kv_slots[length:], upper
        upper.children[self._child_key(node.key, 0)] = node
        return upper

    def _add_leaf(
        self, parent: TreeNode, tokens: np.ndarray, kv_slots: np.ndarray, now: int
    ) -> None:
        leaf = TreeNode(key=tokens.copy(), kv_slots=kv_slots.copy(), parent=parent, last_access=now)
        parent.children[self._child_key(leaf.key, 0)] = leaf
        self._evictable_size += leaf.num_tokens
        self._push_candidate(leaf)

    def _namespace_node(self, namespace: Hashable, now: int) -> TreeNode:
        ns_node = self._root.children.get(namespace)
        if ns_node is None:
            ns_node = TreeNode(_empty_slots(), _empty_slots(), self._root, namespace=namespace)
            self._root.children[namespace] = ns_node
        ns_node.last_access = now
        return ns_node

    def _unlink(self, node: TreeNode) -> None:
        """Remove `node` from its parent's children; sizes are the caller's business."""
        if node.is_namespace:
            del node.parent.children[node.namespace]
        else:
            del node.parent.children[self._child_key(node.key, 0)]
        node.removed = True

    def _record_lookup(self, namespace: Hashable, hit_tokens: int, lookup_tokens: int) -> None:
        stats = self._stats.setdefault(namespace, [0, 0])
        stats[0] += hit_tokens
        stats[1] += lookup_tokens

    def _evictable_leaves(self) -> Iterator[TreeNode]:
        for node in _iter_subtrees([self._root]):
            if not node.children and node.lock_ref == 0 and node.num_tokens > 0:
                yield node

    def _free_unlocked_subtrees(self, ns_node: TreeNode) -> list[np.ndarray]:
        """Detach and collect every unlocked subtree below `ns_node` (whole subtrees: a node's
        descendants are never locked when it is not)."""
        pieces: list[np.ndarray] = []
        stack = [ns_node]
        while stack:
            node = stack.pop()
            for child in list(node.children.values()):
                if child.lock_ref > 0:
                    stack.append(child)
                    continue
                self._unlink(child)
                for freed in _iter_subtrees([child]):
                    freed.removed = True
                    self._evictable_size -= freed.num_tokens
                    pieces.append(freed.kv_slots)
        return pieces

    def _free_orphaned(self, released: list[TreeNode], ns_node: TreeNode) -> None:
        """Free the nodes of a dropped namespace whose lock just reached zero (bottom-up, so
        each has no children left)."""
        pieces: list[np.ndarray] = []
        for node in released:
            if node is ns_node:
                self._orphans.remove(ns_node)
                ns_node.removed = True
                continue
            self._evictable_size -= node.num_tokens
            pieces.append(node.kv_slots)
            self._unlink(node)
        _call_free(ns_node.orphan_free_fn, pieces)


def _path_up(node: TreeNode) -> Iterator[TreeNode]:
    """`node`, its parent, ... up to and including the namespace node (nothing for the root)."""
    while node.parent is not None:
        yield node
        node = node.parent


def _iter_subtrees(starts: Iterable[TreeNode]) -> Iterator[TreeNode]:
    stack = list(starts)
    while stack:
        node = stack.pop()
        yield node
        stack.extend(node.children.values())


def _as_int32(values: Sequence[int] | np.ndarray) -> np.ndarray:
    array = np.asarray(values, dtype=np.int32)
    if array.ndim != 1:
        raise ValueError(f"expected a 1-D sequence, got shape {array.shape}")
    return array


def _concat(pieces: list[np.ndarray]) -> np.ndarray:
    return np.concatenate(pieces) if pieces else _empty_slots()


def _call_free(free_fn: FreeFn, pieces: list[np.ndarray]) -> None:
    if pieces:
        free_fn(np.concatenate(pieces))
