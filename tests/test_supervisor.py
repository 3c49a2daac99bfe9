"""Who the launcher's children are (ChildSpec): their names, which sizes the pools, what each
one's environment adds, for one replica, several replicas and tensor-parallel ranks."""

from __future__ import annotations

from radixlora.server.procs.supervisor import ChildSpec, core_specs, proc_kind
from radixlora.topology import TP_RANK_ENV


def test_one_replica_is_the_three_core_children_by_their_plain_names():
    specs = core_specs(1)
    assert [s.name for s in specs] == ["tokenizer", "scheduler", "worker"]
    assert [s.sizes_pools for s in specs] == [False, False, True]
    assert all(s.env() == {} for s in specs)


def test_replicas_each_have_a_scheduler_and_a_worker_on_their_own_device(monkeypatch):
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    specs = core_specs(2)
    assert [s.name for s in specs] == ["tokenizer", "scheduler-dp0", "worker-dp0",
                                       "scheduler-dp1", "worker-dp1"]
    assert [s.name for s in specs if s.sizes_pools] == ["worker-dp0", "worker-dp1"]
    assert ChildSpec("worker", 1).env() == {"CUDA_VISIBLE_DEVICES": "1"}
    assert ChildSpec("scheduler", 1).env() == {}
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,6")
    assert ChildSpec("worker", 1).env() == {"CUDA_VISIBLE_DEVICES": "6"}
    assert ChildSpec("worker", 2).env() == {"CUDA_VISIBLE_DEVICES": ""}


def test_a_worker_rank_is_named_as_it_names_itself_and_gets_its_rank():
    rank = ChildSpec("worker", rank=3)
    assert rank.name == "worker-tp3" and not rank.sizes_pools
    assert rank.env() == {TP_RANK_ENV: "3"}
    assert proc_kind(rank.name) == "worker" and proc_kind("scheduler") == "scheduler"
