"""The data-parallel router's policy without servers: its prefix tree (matches, splits,
namespaces, eviction), each rule of the cache-aware choice, the load bound, round-robin, and
the radix hit rate of a 10-adapter workload with shared prefixes under both policies against
ideal per-replica radix caches."""

from __future__ import annotations

import random

import numpy as np
import pytest

from radixlora.sched.adapter_choice import AdapterChoice
from radixlora.server.procs.router import PrefixTree, Router, namespace_of


def ids(*tokens: int) -> np.ndarray:
    return np.asarray(tokens, np.int32)


def on(name: str | None) -> list[AdapterChoice] | None:
    return None if name is None else [AdapterChoice(name)]


def test_tree_matches_each_replica_prefix_and_splits_edges():
    tree = PrefixTree(2, max_tokens=100)
    tree.insert((), ids(1, 2, 3, 4), 0, now=1.0)
    tree.insert((), ids(1, 2, 9), 1, now=2.0)  # splits the edge after (1, 2)
    assert tree.match((), ids(1, 2, 3, 4, 5)) == [4, 2]
    assert tree.match((), ids(1, 2, 9, 9)) == [2, 3]
    assert tree.match((), ids(7)) == [0, 0]
    assert tree.size == [4, 3]


def test_namespaces_never_share_prefixes():
    tree = PrefixTree(2, max_tokens=100)
    upper = namespace_of(on("upper"))
    tree.insert(upper, ids(1, 2, 3), 0, now=1.0)
    assert tree.match((), ids(1, 2, 3)) == [0, 0]
    assert tree.match(namespace_of(on("legal")), ids(1, 2, 3)) == [0, 0]
    assert tree.match(upper, ids(1, 2, 3)) == [3, 0]


def test_namespace_ignores_choice_order_but_not_weights():
    a, b = AdapterChoice("a", 1.0), AdapterChoice("b", 0.5)
    assert namespace_of([a, b]) == namespace_of([b, a])
    assert namespace_of([a, b]) != namespace_of([a, AdapterChoice("b", 1.0)])


def test_eviction_drops_least_recently_routed_leaves_first():
    tree = PrefixTree(1, max_tokens=10)
    tree.insert((), ids(1, 2, 3, 4), 0, now=1.0)
    tree.insert((), ids(5, 6, 7, 8), 0, now=2.0)
    tree.insert((), ids(1, 2, 3, 4), 0, now=3.0)  # touched again: newer than (5..8)
    tree.insert((), ids(9, 10, 11, 12), 0, now=4.0)  # 12 tokens > 10: trim to 9
    assert tree.size == [8]
    assert tree.match((), ids(5, 6, 7, 8)) == [0]
    assert tree.match((), ids(1, 2, 3, 4)) == [4]
    assert tree.match((), ids(9, 10, 11, 12)) == [4]


def test_eviction_keeps_other_replicas_nodes_and_forgets_empty_namespaces():
    tree = PrefixTree(2, max_tokens=6)
    tree.insert(("a",), ids(1, 2, 3), 0, now=1.0)
    tree.insert(("a",), ids(1, 2, 3), 1, now=1.5)
    tree.insert(("b",), ids(4, 5, 6), 0, now=2.0)
    tree.insert(("c",), ids(7, 8, 9), 0, now=3.0)  # replica 0 over 6: ("a",) goes first
    assert tree.match(("a",), ids(1, 2, 3)) == [0, 3]
    assert tree.holders(("a",)) == {1}
    tree.insert(("d",), ids(1, 1, 1, 1, 1, 1, 1), 0, now=4.0)
    assert ("b",) not in tree.roots and ("c",) not in tree.roots


def test_a_cached_prefix_wins_then_adapter_affinity_then_least_loaded():
    router = Router(2, balance_abs=100)
    prompt = ids(*range(1, 21))
    assert router.route(on("upper"), prompt) == 0  # nothing known: least loaded, lowest index
    router.load = [5, 0]  # busier, but within the bound
    assert router.route(on("upper"), ids(*range(1, 15), 99)) == 0  # 14 of 15 tokens cached
    assert router.route(on("upper"), ids(50, 51)) == 0  # no prefix: where upper runs
    assert router.route(on("legal"), ids(50, 51)) == 1  # unknown adapter: least loaded
    reasons = {why for (_, why) in router.decisions}
    assert reasons == {"least_loaded", "prefix", "adapter"}


def test_the_load_bound_sends_a_request_to_an_idle_replica():
    router = Router(2, balance_abs=4)
    prompt = ids(1, 2, 3, 4)
    replicas = [router.route(None, prompt) for _ in range(12)]
    # the prefix holds replica 0 until it has 4 more outstanding than replica 1, then the
    # two alternate: neither is ever more than the bound ahead
    assert replicas[:5] == [0, 0, 0, 0, 1]
    assert max(router.load) - min(router.load) <= 4
    assert router.decisions[(1, "balance")] >= 1
    for replica in replicas:
        router.release(replica)
    assert router.load == [0, 0]


def test_round_robin_cycles_whatever_the_request():
    router = Router(3, "round_robin")
    assert [router.route(on("upper"), ids(1, 2)) for _ in range(6)] == [0, 1, 2, 0, 1, 2]


def test_a_pinned_replica_and_samples_count_as_load():
    router = Router(2)
    assert router.route(None, ids(1), samples=3, replica=1) == 1
    assert router.load == [0, 3]
    with pytest.raises(ValueError, match="router policy"):
        Router(2, "random")


def hit_rate(policy: str, workload: list[tuple[str, np.ndarray]], replicas: int = 2) -> float:
    """Radix hit tokens / prompt tokens when each request runs alone (its predecessors
    finished) on the replica `policy` picks, each replica an unbounded radix cache keyed on
    (adapter, tokens)."""
    router = Router(replicas, policy)
    seen: list[dict[str, list[np.ndarray]]] = [{} for _ in range(replicas)]
    hits = 0
    for adapter, prompt in workload:
        replica = router.route(on(adapter), prompt)
        cached = seen[replica].setdefault(adapter, [])
        hits += max((common(prompt, p) for p in cached), default=0)
        cached.append(prompt)
        router.release(replica)
    return hits / sum(len(p) for _, p in workload)


def common(a: np.ndarray, b: np.ndarray) -> int:
    m = min(len(a), len(b))
    same = a[:m] == b[:m]
    return m if same.all() else int(same.argmin())


def shared_prefix_workload(adapters: int = 10, per_adapter: int = 4, seed: int = 0):
    """Each adapter's requests share a 32-token system prompt and differ in 8 tokens; the
    requests arrive in a random order."""
    rng = random.Random(seed)
    work = []
    for a in range(adapters):
        system = [1000 + 40 * a + i for i in range(32)]
        for _ in range(per_adapter):
            work.append((f"a{a}", np.asarray(system + [rng.randrange(1, 900) for _ in range(8)],
                                             np.int32)))
    rng.shuffle(work)
    return work


def test_cache_aware_beats_round_robin_on_shared_prefixes():
    work = shared_prefix_workload()
    cache_aware, round_robin = hit_rate("cache_aware", work), hit_rate("round_robin", work)
    # each adapter's system prompt is computed once under the router, so 30 of the 40
    # prompts hit 32 of their 40 tokens; round-robin sends every adapter to both replicas in
    # this order, which computes each system prompt twice: 20 hits
    assert cache_aware == pytest.approx(30 * 32 / 1600)
    assert round_robin == pytest.approx(20 * 32 / 1600)


# ---- the tokenizer routes -------------------------------------------------------------------


@pytest.fixture
def tokenizer():
    from radixlora.demo import DEMO_MODEL_DIR
    from radixlora.server.args import ServerArgs
    from radixlora.server.procs.tokenizer_proc import TokenizerService
    from tests.server_harness import sized

    return TokenizerService(sized(ServerArgs(model=str(DEMO_MODEL_DIR), data_parallel_size=2)))


def generate(rid: str, adapter: str | None = None, n: int = 1, rank: int | None = None):
    from radixlora.sampling_params import SamplingParams
    from radixlora.server.messages import GenerateReq

    return GenerateReq(rid=rid, params=SamplingParams(max_tokens=4, n=n), adapters=on(adapter),
                       prompt="input: the red fox ate 42 fish\noutput:\n",
                       data_parallel_rank=rank)


def token_out(rid: str, index: int = 0, finish: str | None = None):
    from radixlora.server.messages import TokenBatch, TokenOut

    out = TokenOut(rid=rid, index=index, token_ids=ids(5).tobytes(), logprobs=[0.0], top=None,
                   finish_reason=finish, prompt_tokens=12, cached_tokens=0)
    return TokenBatch(outputs=[out])


def test_the_tokenizer_routes_and_later_messages_follow_the_request(tokenizer):
    from radixlora.server.messages import AbortReq

    [first], _ = tokenizer.on_generate(generate("r1", "upper", n=2))
    [second], _ = tokenizer.on_generate(generate("r2", "reverse"))
    assert tokenizer.routes == {"r1": 0, "r2": 1}  # the second adapter: least loaded
    assert tokenizer.router.load == [2, 1]  # samples
    aborts, _ = tokenizer.on_tokens(token_out("r1", 0, finish="length"))
    assert aborts == [] and tokenizer.router.load == [1, 1]
    [abort] = tokenizer.on_abort(AbortReq(rid="r2"))
    assert tokenizer.replicas_for(abort) == [1] and tokenizer.router.load == [1, 0]
    assert tokenizer.replicas_for(AbortReq(rid="unknown")) == [0, 1]  # every replica
    stats = tokenizer.router_stats()
    assert stats.outstanding == [1, 0] and sum(stats.decisions.values()) == 2


def test_a_pinned_replica_out_of_range_is_a_400(tokenizer):
    [pinned], _ = tokenizer.on_generate(generate("p", rank=1))
    assert tokenizer.replicas_for(pinned) == [1]
    to_sched, [error] = tokenizer.on_generate(generate("q", rank=2))
    assert to_sched == [] and (error.status, error.param) == (400, "data_parallel_rank")


def test_one_replica_or_round_robin_keeps_no_tree():
    for router in (Router(1), Router(2, "round_robin")):
        router.route(on("upper"), ids(1, 2, 3))
        assert router.tree.roots == {} and router.tree.size == [0] * router.num_replicas
