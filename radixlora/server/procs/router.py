"""The data-parallel router: which replica (scheduler + worker) runs a tokenized request.

`cache_aware`, in the manner of SGLang's cache-aware router: one approximate prefix tree per
cache namespace, shared by the replicas as tenants. A namespace is the request's adapter
choices (names and weights, sorted: the names' current versions are only known to the
schedulers, so a re-published adapter keeps its routes, which costs at most a miss). Each
node records which replicas were last sent that prefix and when; a replica's tokens are
bounded by its KV capacity, least recently routed leaves going first, so the tree follows
what the replicas' radix caches can still hold. A request goes, in this order:

1. to the replica with the longest cached prefix, if it covers `cache_threshold` of the
   prompt;
2. else to a replica its adapter set was recently routed to (so the adapters are resident
   there), the least loaded of them;
3. else to the least loaded replica (ties: the smallest tree, i.e. the most cache room).

The load bound overrides that choice: if the chosen replica has `balance_abs` more requests
outstanding than the least loaded one and more than `balance_rel` times as many, the request
goes to the least loaded one instead, so no request queues behind a busy replica while
another idles. A replica's load is the router's own count of samples it sent there that have
not finished: exact and current, where the schedulers' stats are up to half a second old.

`round_robin` cycles through the replicas whatever the request (the baseline)."""

from __future__ import annotations

import collections
import heapq
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from radixlora.sched.adapter_choice import AdapterChoice

POLICIES = ("cache_aware", "round_robin")
CACHE_THRESHOLD = 0.5  # share of the prompt a cached prefix must cover to decide alone
BALANCE_REL = 1.5
EVICT_TO = 0.9  # a replica over its token bound is trimmed to this share of it

Namespace = tuple[tuple[str, float], ...]


def namespace_of(choices: Sequence[AdapterChoice] | None) -> Namespace:
    """The routing key of a request's adapter choices (order-free, weights included)."""
    return tuple(sorted((c.name, float(c.weight)) for c in choices or ()))


@dataclass(eq=False)
class Node:
    """An edge of the prefix tree: `key` (tokens) leads from `parent` to this node."""

    key: np.ndarray
    parent: Node | None
    children: dict[int, Node] = field(default_factory=dict)
    tenants: dict[int, float] = field(default_factory=dict)  # replica -> last routed (time)


def common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    same = a[:m] == b[:m]
    return m if same.all() else int(same.argmin())


class PrefixTree:
    """Per namespace, a radix tree over token ids whose nodes name the replicas (tenants)
    that were sent that prefix. Invariant: a node's tenants include its children's, so a
    replica's match is the deepest node on the path that names it."""

    def __init__(self, num_replicas: int, max_tokens: int):
        self.roots: dict[Namespace, Node] = {}
        self.size = [0] * num_replicas  # tokens each replica holds in the tree
        self.max_tokens = max_tokens

    def match(self, ns: Namespace, ids: np.ndarray) -> list[int]:
        """Per replica, the length of its longest prefix of ids in namespace ns."""
        matched = [0] * len(self.size)
        node, pos = self.roots.get(ns), 0
        while node is not None and pos < len(ids):
            child = node.children.get(int(ids[pos]))
            if child is None:
                break
            k = common_prefix(child.key, ids[pos:])
            for replica in child.tenants:
                matched[replica] = pos + k
            pos += k
            node = child if k == len(child.key) else None
        return matched

    def holders(self, ns: Namespace) -> set[int]:
        root = self.roots.get(ns)
        return set() if root is None else set(root.tenants)

    def insert(self, ns: Namespace, ids: np.ndarray, replica: int, now: float) -> None:
        node = self.roots.setdefault(ns, Node(np.empty(0, np.int32), None))
        node.tenants[replica] = now
        pos = 0
        while pos < len(ids):
            child = node.children.get(int(ids[pos]))
            if child is None:
                child = Node(ids[pos:].copy(), node)
                node.children[int(ids[pos])] = child
            k = common_prefix(child.key, ids[pos:])
            if k < len(child.key):
                child = self._split(child, k)
            if replica not in child.tenants:
                self.size[replica] += len(child.key)
            child.tenants[replica] = now
            node, pos = child, pos + k
        if self.size[replica] > self.max_tokens:
            self.evict(replica, int(self.max_tokens * EVICT_TO))

    def _split(self, child: Node, k: int) -> Node:
        """Cut child's edge after k tokens; the returned upper node keeps child's tenants."""
        parent = child.parent
        upper = Node(child.key[:k], parent, tenants=dict(child.tenants))
        parent.children[int(child.key[0])] = upper
        child.key = child.key[k:]
        child.parent = upper
        upper.children[int(child.key[0])] = child
        return upper

    def evict(self, replica: int, target: int) -> None:
        """Drop replica's least recently routed leaves until it holds at most target tokens."""
        order = itertools.count()
        heap = [(n.tenants[replica], next(order), n) for n in self._leaves(replica)]
        heapq.heapify(heap)
        while heap and self.size[replica] > target:
            _, _, node = heapq.heappop(heap)
            parent = self._drop(node, replica)
            if parent is not None and parent.parent is not None and not any(
                    replica in c.tenants for c in parent.children.values()):
                heapq.heappush(heap, (parent.tenants[replica], next(order), parent))

    def _leaves(self, replica: int) -> list[Node]:
        out, stack = [], [r for r in self.roots.values() if replica in r.tenants]
        while stack:
            node = stack.pop()
            owned = [c for c in node.children.values() if replica in c.tenants]
            if owned:
                stack += owned
            elif node.parent is not None:
                out.append(node)
        return out

    def _drop(self, node: Node, replica: int) -> Node | None:
        """Remove replica from a node none of whose children it holds; the node goes when no
        replica holds it. Returns its parent."""
        del node.tenants[replica]
        self.size[replica] -= len(node.key)
        parent = node.parent
        if not node.tenants:
            del parent.children[int(node.key[0])]
        if parent.parent is None and not any(replica in c.tenants
                                             for c in parent.children.values()):
            parent.tenants.pop(replica, None)  # a namespace root
            if not parent.tenants:
                self.roots = {ns: r for ns, r in self.roots.items() if r is not parent}
            return None
        return parent


@dataclass
class Decision:
    replica: int
    reason: str  # prefix, adapter, least_loaded, balance, round_robin


class Router:
    """Picks a replica per request and counts each replica's outstanding samples."""

    def __init__(self, num_replicas: int, policy: str = "cache_aware", *,
                 max_tree_tokens: int = 1 << 20, balance_abs: int = 8,
                 cache_threshold: float = CACHE_THRESHOLD, balance_rel: float = BALANCE_REL):
        if policy not in POLICIES:
            raise ValueError(f"router policy must be one of {POLICIES}, got {policy!r}")
        self.policy = policy
        self.load = [0] * num_replicas
        self.tree = PrefixTree(num_replicas, max_tree_tokens)
        self.balance_abs = balance_abs
        self.balance_rel = balance_rel
        self.cache_threshold = cache_threshold
        self.rotation = itertools.cycle(range(num_replicas))
        self.decisions: collections.Counter[tuple[int, str]] = collections.Counter()

    @property
    def num_replicas(self) -> int:
        return len(self.load)

    def route(self, choices: Sequence[AdapterChoice] | None, ids: np.ndarray,
              samples: int = 1, replica: int | None = None) -> int:
        """The replica for a request of `samples` samples (its load counts them until
        `release`); `replica` pins it (a warm-up of each replica)."""
        ns = namespace_of(choices)
        if replica is not None:
            decision = Decision(replica, "pinned")
        elif self.policy == "round_robin" or self.num_replicas == 1:
            decision = Decision(next(self.rotation), "round_robin")
        else:
            decision = self.bounded(self.preferred(ns, ids))
        if self.policy == "cache_aware" and self.num_replicas > 1:
            self.tree.insert(ns, ids, decision.replica, time.monotonic())
        self.load[decision.replica] += samples
        self.decisions[(decision.replica, decision.reason)] += 1
        return decision.replica

    def release(self, replica: int, samples: int = 1) -> None:
        self.load[replica] = max(0, self.load[replica] - samples)

    def preferred(self, ns: Namespace, ids: np.ndarray) -> Decision:
        matched = self.tree.match(ns, ids)
        best = max(range(self.num_replicas), key=lambda r: (matched[r], -self.load[r]))
        if matched[best] >= self.cache_threshold * len(ids) and matched[best] > 0:
            return Decision(best, "prefix")
        holders = self.tree.holders(ns)
        if holders:
            return Decision(min(holders, key=lambda r: (self.load[r], r)), "adapter")
        return Decision(self.least_loaded(), "least_loaded")

    def least_loaded(self) -> int:
        return min(range(self.num_replicas),
                   key=lambda r: (self.load[r], self.tree.size[r], r))

    def bounded(self, decision: Decision) -> Decision:
        """The least loaded replica instead, when the chosen one is busier past both
        thresholds."""
        idle = self.least_loaded()
        busy, light = self.load[decision.replica], self.load[idle]
        if busy - light >= self.balance_abs and busy > self.balance_rel * light:
            return Decision(idle, "balance")
        return decision

    def snapshot(self) -> dict[str, object]:
        """Outstanding samples and decisions per replica (the router's report to the api)."""
        return {
            "policy": self.policy,
            "outstanding": list(self.load),
            "tree_tokens": list(self.tree.size),
            "decisions": {f"{r}:{why}": n for (r, why), n in sorted(self.decisions.items())},
        }
