"""Adapters packed ahead for the workers' pool layouts (radixlora.lora.host_cache's packed
files): a packed file reads back exactly what its layout packs and is not used for anything
else, the registry's snapshots hold one per tensor-parallel rank, and a worker that loads an
adapter from it serves what loading the adapter's own files serves."""

from __future__ import annotations

from pathlib import Path

import msgspec
import pytest
import torch

from radixlora.config import ModelConfig
from radixlora.distributed import Shard
from radixlora.errors import AdapterError
from radixlora.lora import registration
from radixlora.lora.adapter import load_adapter
from radixlora.lora.host_cache import PackedAdapter, packed_name, read_packed, write_packed
from radixlora.lora.layout import PoolLayout, pool_layouts
from radixlora.lora.packer import ProcessPacker
from radixlora.lora.registration import HashCache, PackTarget, load_adapters
from radixlora.sched.token_bucket import TokenBucket
from radixlora.server.messages import AdminReq
from radixlora.server.procs.registry_proc import RegistryCore
from radixlora.step_plan import AdapterLoad
from radixlora.worker.adapter_pool import AdapterPool
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import registry_turn
from tests.test_hotswap_units import _assert_nothing_held, _req, _services, _want
from tests.test_server_units import _drive

MAX_RANK = 64


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("packed") / "model")


@pytest.fixture(scope="module")
def cfg(model) -> ModelConfig:
    return ModelConfig.from_dir(model)


@pytest.fixture(scope="module")
def adapter_dir(model, tmp_path_factory) -> Path:
    return build_tiny_adapter(model, tmp_path_factory.mktemp("a") / "a", rank=4, seed=7)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int8])
def test_packed_file_reads_back_what_the_layout_packs(cfg, adapter_dir, tmp_path, dtype):
    adapter = load_adapter("a", adapter_dir, cfg, MAX_RANK)
    layout = PoolLayout(cfg, dtype)
    packed = layout.pack(adapter)
    write_packed(tmp_path, layout.key, packed)
    back = read_packed(tmp_path, layout.key, adapter.adapter_id, pin=False)
    assert back.adapter_id == adapter.adapter_id and back.group_ranks == packed.group_ranks
    assert back.data.dtype == packed.data.dtype and torch.equal(back.data, packed.data)
    assert [p.name for p in tmp_path.iterdir()] == [packed_name(layout.key)]  # no temp left


def test_a_packed_file_not_made_for_this_adapter_and_layout_is_not_used(cfg, adapter_dir,
                                                                       tmp_path):
    adapter = load_adapter("a", adapter_dir, cfg, MAX_RANK)
    f32, bf16 = PoolLayout(cfg, torch.float32), PoolLayout(cfg, torch.bfloat16)
    path = write_packed(tmp_path, f32.key, f32.pack(adapter))
    assert read_packed(tmp_path, f32.key, "0" * 64, pin=False) is None  # another adapter
    assert read_packed(tmp_path, bf16.key, adapter.adapter_id, pin=False) is None  # no file
    path.rename(tmp_path / packed_name(bf16.key))  # the file of another layout
    assert read_packed(tmp_path, bf16.key, adapter.adapter_id, pin=False) is None
    path = write_packed(tmp_path, f32.key, f32.pack(adapter))
    whole = path.read_bytes()
    for broken in (whole[:-4], whole + b"\0" * 4, b"\xff" * 8 + whole[8:], b"", b"junk"):
        path.write_bytes(broken)
        assert read_packed(tmp_path, f32.key, adapter.adapter_id, pin=False) is None


def test_layout_keys_are_those_of_the_workers_pools(cfg):
    """The registry names each rank's layout as that rank's pool does, and no two layouts
    (ranks, dtypes) share a name."""
    keys = set()
    for dtype in (torch.float32, torch.bfloat16, torch.int8):
        (single,) = pool_layouts(cfg, dtype, 1)
        assert single.key == AdapterPool(cfg, 8, dtype, "cpu").layout.key
        keys.add(single.key)
        for rank, layout in enumerate(pool_layouts(cfg, dtype, 2)):
            shard = Shard(rank, 2, cfg)
            assert layout.key == AdapterPool(shard.local, 8, dtype, "cpu", shard=shard).layout.key
            keys.add(layout.key)
    assert len(keys) == 9


def test_tensor_parallel_packing_is_each_ranks_slice(cfg, adapter_dir):
    adapter = load_adapter("a", adapter_dir, cfg, MAX_RANK)
    for rank, layout in enumerate(pool_layouts(cfg, torch.float32, 2)):
        shard = Shard(rank, 2, cfg)
        pool = AdapterPool(shard.local, 8, torch.float32, "cpu", shard=shard)
        assert torch.equal(layout.pack(adapter).data, pool.pack(adapter).data)


def _core(model, root: Path, state: Path, layouts, events: list) -> RegistryCore:
    return RegistryCore(root, state, ModelConfig.from_dir(model), MAX_RANK, 32,
                        TokenBucket(1.0, 1, now=0.0), events.append, layouts=layouts)


def _publish_all(core: RegistryCore) -> None:
    core.on_changed(core.names_on_disk())
    for _ in range(10):
        registry_turn(core, 0.0)


def _assert_snapshots_packed(events, layouts, cfg) -> None:
    added = [e for e in events if e.kind == "added"]
    assert added
    for event in added:
        adapter = load_adapter(event.name, event.path, cfg, MAX_RANK)
        for layout in layouts:
            packed = read_packed(event.path, layout.key, event.adapter_id, pin=False)
            assert torch.equal(packed.data, layout.pack(adapter).data), event.name


def test_registry_snapshots_hold_the_adapter_packed_for_every_rank(model, cfg, tmp_path):
    """A full directory (validated together) and an adapter added later (validated alone)
    are published with a packed file per tensor-parallel rank in their snapshots; a restart
    whose hash cache knows the adapters still packs them (the cache holds no values)."""
    root = tmp_path / "dir"
    root.mkdir()
    for i in range(registration_batch()):
        build_tiny_adapter(model, root / f"s{i:02d}", rank=1 + i % 4, seed=100 + i)
    layouts = pool_layouts(cfg, torch.float32, 2)
    events: list = []
    core = _core(model, root, tmp_path / "state", layouts, events)
    _publish_all(core)
    build_tiny_adapter(model, root / "late", rank=3, seed=99)
    core.on_changed(["late"])
    registry_turn(core, 5.0)
    assert [e.name for e in events][-1] == "late"
    _assert_snapshots_packed(events, layouts, cfg)
    assert not any((tmp_path / "state" / "packed").iterdir())  # every one taken
    restarted: list = []
    _publish_all(_core(model, root, tmp_path / "state2", layouts, restarted))
    assert len(restarted) == len(events)
    _assert_snapshots_packed(restarted, layouts, cfg)


def registration_batch() -> int:
    from radixlora.server.procs.registry_proc import REGISTER_BATCH

    return REGISTER_BATCH[0] + 2


def test_validation_in_a_process_packs_too(model, cfg, adapter_dir, tmp_path):
    """The job the spawned validation processes run packs what the threads pack."""
    (layout,) = pool_layouts(cfg, torch.bfloat16, 1)
    pack = PackTarget(tmp_path / "ahead", (layout,))
    raw = registration.validate_job(("a", str(adapter_dir), cfg, MAX_RANK, pack))
    adapter, _ = msgspec.msgpack.decode(raw, type=registration.JobOutcome).outcome()
    assert not adapter.weights and pack.done(adapter.adapter_id)
    threads = PackTarget(tmp_path / "threads", (layout,))
    (outcome,) = load_adapters({"a": adapter_dir}, cfg, MAX_RANK, keep_weights=False,
                               cache=HashCache(tmp_path / "cache.json"), pack=threads).values()
    assert outcome.adapter_id == adapter.adapter_id
    ours, theirs = (read_packed(p.directory(adapter.adapter_id), layout.key, adapter.adapter_id,
                                pin=False) for p in (pack, threads))
    assert torch.equal(ours.data, theirs.data)


def test_worker_loads_from_the_packed_file_alone(model, adapter_dir, tmp_path, monkeypatch):
    """An admin load's snapshot holds the adapter packed; the worker loads it from there
    without reading the adapter's files, and serves what the Engine serves from them."""
    sched, worker = _services(model, tmp_path)
    reply = sched.lifecycle.admin(AdminReq(qid=1, op="load", name="a", path=str(adapter_dir)))
    assert reply.status == 200
    snapshot = Path(sched.adapters.by_name["a"].path)
    assert (snapshot / packed_name(worker.runner.adapter_pool.layout.key)).is_file()

    def no_file_reads(load):
        raise AssertionError(f"read {load.path} instead of its packed file")

    monkeypatch.setattr(worker.reader, "source", no_file_reads)
    got = _drive(sched, worker, [_req("r", "a")])
    assert got[("r", 0)] == _want(model, adapter_dir)
    _assert_nothing_held(sched)


def test_packed_files_outside_the_snapshots_are_never_read(model, cfg, tmp_path, monkeypatch):
    """A packed file in a user's adapter directory (not a snapshot of the server's store) is
    ignored, even one that names the adapter's id: the worker reads, checks and packs the
    adapter's own files."""
    user_dir = build_tiny_adapter(model, tmp_path / "user" / "u", rank=4, seed=7)
    adapter = load_adapter("u", user_dir, cfg, MAX_RANK)
    other = load_adapter("o", build_tiny_adapter(model, tmp_path / "o", rank=4, seed=8), cfg,
                         MAX_RANK)
    sched, worker = _services(model, tmp_path / "state", adapters={"u": str(user_dir)})
    layout = worker.runner.adapter_pool.layout
    forged = layout.pack(other)
    write_packed(user_dir, layout.key, PackedAdapter(adapter.adapter_id, forged.group_ranks,
                                                     forged.data))
    reads, real = [], worker.reader.source
    monkeypatch.setattr(worker.reader, "source", lambda load: reads.append(load.path) or real(load))
    got = _drive(sched, worker, [_req("r", "u")])
    assert reads == [str(user_dir)]
    assert got[("r", 0)] == _want(model, user_dir)


def test_worker_packs_adapters_without_a_snapshot_in_a_process(model, cfg, tmp_path,
                                                                monkeypatch):
    """With a packer (the worker on CUDA), an adapter that has no snapshot (--adapter) is
    read, validated and packed by a spawned process: the worker never reads its files, serves
    what the Engine serves from them and keeps no packed file; an adapter whose files no
    longer hash to the id the scheduler validated, or that fails validation, is refused."""
    user_dir = build_tiny_adapter(model, tmp_path / "user" / "u", rank=4, seed=7)
    sched, worker = _services(model, tmp_path / "state", adapters={"u": str(user_dir)})
    layout = worker.runner.adapter_pool.layout
    worker.reader.packer = ProcessPacker(tmp_path / "packing", cfg, MAX_RANK, processes=1)

    def no_file_reads(load):
        raise AssertionError(f"read {load.path} in the worker")

    monkeypatch.setattr(worker.reader, "source", no_file_reads)
    try:
        got = _drive(sched, worker, [_req("r", "u")])
        assert got[("r", 0)] == _want(model, user_dir)
        assert worker.reader.read_counts == {"a packing process": 1}
        assert not list((tmp_path / "packing").iterdir())
        stale = AdapterLoad(adapter_id="0" * 64, name="u", path=str(user_dir), rows=b"")
        with pytest.raises(AdapterError, match="changed on disk after validation"):
            worker.reader.packer.read(stale, layout, pin=False)
        broken = tmp_path / "broken"
        broken.mkdir()
        (broken / "adapter_config.json").write_text("{")
        with pytest.raises(AdapterError, match="no adapter_model.safetensors"):
            worker.reader.packer.read(AdapterLoad(adapter_id="0" * 64, name="b", path=str(broken),
                                           rows=b""), layout, pin=False)
    finally:
        worker.reader.packer.close()
    assert not (tmp_path / "packing").exists()
    _assert_nothing_held(sched)


def test_a_packed_file_must_fit_the_pool(cfg, adapter_dir):
    """What a packed file says it holds is checked against the layout before any row is
    written: its groups in order, ranks of at least 1, and exactly the bytes they take."""
    adapter = load_adapter("a", adapter_dir, cfg, MAX_RANK)
    layout = PoolLayout(cfg, torch.float32)
    packed = layout.pack(adapter)
    assert layout.holds(packed)
    ranks = packed.group_ranks
    assert len(ranks) > 1
    first = next(iter(ranks))
    wrong = [{**ranks, first: ranks[first] + 1}, dict(reversed(ranks.items())), {"mlp": 1},
             dict.fromkeys(ranks, 0), {}]
    for bad in wrong:
        assert not layout.holds(PackedAdapter(packed.adapter_id, bad, packed.data)), bad
    assert not layout.holds(PackedAdapter(packed.adapter_id, ranks, packed.data[:-1]))


def test_worker_reads_the_files_when_the_packed_file_does_not_fit(model, adapter_dir, tmp_path,
                                                                  monkeypatch):
    sched, worker = _services(model, tmp_path)
    reply = sched.lifecycle.admin(AdminReq(qid=1, op="load", name="a", path=str(adapter_dir)))
    assert reply.status == 200
    snapshot = Path(sched.adapters.by_name["a"].path)
    layout = worker.runner.adapter_pool.layout
    packed = read_packed(snapshot, layout.key, sched.adapters.by_name["a"].adapter_id, pin=False)
    short = PackedAdapter(packed.adapter_id, packed.group_ranks, packed.data[:-8])
    write_packed(snapshot, layout.key, short)
    reads, real = [], worker.reader.source
    monkeypatch.setattr(worker.reader, "source", lambda load: reads.append(load.path) or real(load))
    got = _drive(sched, worker, [_req("r", "a")])
    assert reads == [str(snapshot)]
    assert got[("r", 0)] == _want(model, adapter_dir)
    _assert_nothing_held(sched)
