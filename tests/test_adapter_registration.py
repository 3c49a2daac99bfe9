"""Registration of many adapters (radixlora.lora.registration): parallel validation gives what
serial validation gives, failures stay typed and in place, and the content-hash cache hits
only for the very files it validated."""

from __future__ import annotations

import json
import logging
import os
import shutil
import stat
from pathlib import Path

import pytest
import torch

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError
from radixlora.lora import registration
from radixlora.lora.adapter import LoraAdapter, load_adapter
from radixlora.lora.registration import (
    CACHE_FILE,
    HashCache,
    adapter_stamp,
    cache_dir,
    iter_adapters,
    load_adapters,
)
from radixlora.sched.adapter_registry import AdapterRegistry
from radixlora.sched.token_bucket import TokenBucket
from radixlora.server.args import ServerArgs
from radixlora.server.procs.registry_proc import RegistryCore
from radixlora.server.procs.scheduler_proc import SchedulerService
from radixlora.server.procs.worker_proc import make_executor, prefetch_adapters
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import build_checkpoints, registry_turn, sized

NUM_ADAPTERS = 200
MAX_RANK = 64


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[ModelConfig, dict[str, Path]]:
    root = tmp_path_factory.mktemp("registration")
    model = build_tiny_model(root / "model")
    items = {f"a{i:03d}": build_tiny_adapter(model, root / f"a{i:03d}", rank=1 + i % 8, seed=i)
             for i in range(NUM_ADAPTERS)}
    return ModelConfig.from_dir(model), items


@pytest.fixture
def copies(tiny, tmp_path) -> dict[str, Path]:
    """Ten adapters copied into this test's own directory, free to rewrite."""
    _, items = tiny
    return {name: Path(shutil.copytree(path, tmp_path / name))
            for name, path in list(items.items())[:10]}


@pytest.fixture
def hash_calls(monkeypatch) -> list[int]:
    """Counts the full-content hashes of this process's registrations."""
    calls: list[int] = []
    real = registration.content_hash

    def counted(config_bytes: bytes, tensor_bytes: bytes) -> str:
        calls.append(1)
        return real(config_bytes, tensor_bytes)

    monkeypatch.setattr(registration, "content_hash", counted)
    return calls


def serial_ids(model: ModelConfig, items: dict[str, Path]) -> dict[str, str]:
    return {name: load_adapter(name, path, model, MAX_RANK).adapter_id
            for name, path in items.items()}


def ids(outcomes: dict) -> dict[str, str]:
    return {name: adapter.adapter_id for name, adapter in outcomes.items()}


def test_parallel_registration_gives_the_serial_ids(tiny, monkeypatch):
    model, items = tiny
    monkeypatch.setattr(registration, "PROCESS_MIN_BYTES", 0)
    serial = serial_ids(model, items)
    on_threads = load_adapters(items, model, MAX_RANK, workers=4)
    in_processes = load_adapters(items, model, MAX_RANK, workers=4, keep_weights=False)
    assert ids(on_threads) == serial and list(on_threads) == list(items)
    assert ids(in_processes) == serial and list(in_processes) == list(items)
    for name, path in list(items.items())[::50]:
        expected = load_adapter(name, path, model, MAX_RANK)
        for got in (on_threads[name], in_processes[name]):
            assert (got.rank, got.group_ranks) == (expected.rank, expected.group_ranks)
        for key, (a, b) in expected.weights.items():
            assert torch.equal(on_threads[name].weights[key][0], a)
            assert torch.equal(on_threads[name].weights[key][1], b)
    assert all(not adapter.weights for adapter in in_processes.values())


@pytest.mark.parametrize("keep_weights", [True, False])
def test_a_bad_adapter_fails_in_place_and_the_others_load(tiny, tmp_path, keep_weights,
                                                          monkeypatch):
    model, items = tiny
    monkeypatch.setattr(registration, "PROCESS_MIN_BYTES", 0)
    broken = Path(shutil.copytree(items["a100"], tmp_path / "broken"))
    (broken / "adapter_config.json").write_text(json.dumps({"r": "eight"}))
    items = {**items, "a100": broken, "a150": tmp_path / "missing"}
    outcomes = load_adapters(items, model, MAX_RANK, workers=4, keep_weights=keep_weights)
    assert list(outcomes) == list(items)
    for name in ("a100", "a150"):
        assert isinstance(outcomes[name], AdapterError)
        with pytest.raises(AdapterError) as serial:
            load_adapter(name, items[name], model, MAX_RANK)
        assert (str(outcomes[name]), outcomes[name].code) == (str(serial.value),
                                                              serial.value.code)
    others = {n: a for n, a in outcomes.items() if n not in ("a100", "a150")}
    assert all(isinstance(a, LoraAdapter) for a in others.values())


def test_registry_load_all_fails_on_the_first_bad_adapter_in_order(tiny, tmp_path):
    model, items = tiny
    chosen = dict(list(items.items())[:5])
    chosen["a003"] = tmp_path / "missing"
    registry = AdapterRegistry(model, MAX_RANK, 4, 512, keep_weights=False)
    with pytest.raises(AdapterError, match="'a003'"):
        registry.load_all(chosen, cache=HashCache(tmp_path / CACHE_FILE))
    del chosen["a003"]
    registered = registry.load_all(chosen, cache=HashCache(tmp_path / CACHE_FILE))
    assert [a.name for a in registered] == list(chosen)
    assert {a.name: a.adapter_id for a in registered} == serial_ids(model, chosen)


def test_a_second_registration_hits_the_cache_and_hashes_nothing(tiny, copies, tmp_path,
                                                                 hash_calls):
    model, _ = tiny
    path = tmp_path / "cache" / CACHE_FILE
    first = load_adapters(copies, model, MAX_RANK, keep_weights=False, cache=HashCache(path))
    assert len(hash_calls) == len(copies)
    restarted = HashCache(path)
    second = load_adapters(copies, model, MAX_RANK, keep_weights=False, cache=restarted)
    assert len(hash_calls) == len(copies) and restarted.hits == len(copies)
    assert ids(second) == ids(first) == serial_ids(model, copies)
    for name, adapter in second.items():
        assert (adapter.rank, adapter.group_ranks) == (first[name].rank, first[name].group_ranks)
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700


def test_a_rewritten_file_misses_and_gets_its_new_hash(tiny, copies, tmp_path, hash_calls):
    model, _ = tiny
    path = tmp_path / CACHE_FILE
    load_adapters(copies, model, MAX_RANK, keep_weights=False, cache=HashCache(path))
    tensors = copies["a001"] / "adapter_model.safetensors"
    before = tensors.stat()
    build_tiny_adapter(tiny_model_dir(copies), copies["a001"], rank=2, seed=999)
    os.utime(tensors, ns=(before.st_atime_ns, before.st_mtime_ns))  # mtime put back
    assert tensors.stat().st_size == before.st_size
    hash_calls.clear()
    outcomes = load_adapters(copies, model, MAX_RANK, keep_weights=False, cache=HashCache(path))
    assert len(hash_calls) == 1
    assert outcomes["a001"].adapter_id == serial_ids(model, {"a001": copies["a001"]})["a001"]
    assert ids(outcomes) == serial_ids(model, copies)


def tiny_model_dir(copies: dict[str, Path]) -> Path:
    config = json.loads((next(iter(copies.values())) / "adapter_config.json").read_text())
    return Path(config["base_model_name_or_path"])


def test_a_hit_still_checks_the_adapter_against_this_server(tiny, copies, tmp_path,
                                                            hash_calls):
    model, _ = tiny
    path = tmp_path / CACHE_FILE
    load_adapters(copies, model, MAX_RANK, keep_weights=False, cache=HashCache(path))
    hash_calls.clear()
    small = load_adapters(copies, model, 1, keep_weights=False, cache=HashCache(path))
    assert not hash_calls
    assert isinstance(small["a000"], LoraAdapter)  # rank 1
    assert isinstance(small["a001"], AdapterError)
    assert "exceeds the server's max rank 1" in str(small["a001"])
    with pytest.raises(ValueError):
        load_adapters(copies, model, MAX_RANK, cache=HashCache(path))


def test_an_entry_is_only_for_its_stamp(tiny, copies, tmp_path):
    model, _ = tiny
    cache = HashCache(tmp_path / CACHE_FILE)
    load_adapters(copies, model, MAX_RANK, keep_weights=False, cache=cache)
    stamp = adapter_stamp(copies["a002"])
    assert cache.get(stamp) == serial_ids(model, {"a002": copies["a002"]})["a002"]
    moved = copies["a002"].rename(tmp_path / "elsewhere")
    assert adapter_stamp(moved) != stamp
    assert adapter_stamp(tmp_path / "nothing") is None


def test_a_corrupt_cache_file_is_ignored_and_replaced(tiny, copies, tmp_path, caplog):
    model, _ = tiny
    path = tmp_path / CACHE_FILE
    path.write_bytes(b"{not json")
    with caplog.at_level(logging.WARNING, logger="radixlora.lora.registration"):
        cache = HashCache(path)
        outcomes = load_adapters(copies, model, MAX_RANK, keep_weights=False, cache=cache)
    assert ids(outcomes) == serial_ids(model, copies)
    assert sum("ignored" in r.message for r in caplog.records) == 1
    assert len(HashCache(path).entries) == len(copies)
    path.write_text(json.dumps({"version": 1, "entries": {"x": 5}}))
    assert HashCache(path).entries == {}


def test_the_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("RADIXLORA_CACHE_DIR", str(tmp_path / "explicit"))
    assert cache_dir() == tmp_path / "explicit"
    assert HashCache().path == tmp_path / "explicit" / CACHE_FILE
    monkeypatch.delenv("RADIXLORA_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert cache_dir() == tmp_path / "xdg" / "radixlora"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert cache_dir() == tmp_path / "home" / ".cache" / "radixlora"


def test_the_suite_never_writes_the_home_cache():
    assert Path(os.environ["RADIXLORA_CACHE_DIR"]) != Path.home() / ".cache" / "radixlora"


def test_reading_ahead_stops_with_the_consumer(tiny):
    model, items = tiny
    taken = []
    for name, adapter in iter_adapters(items, model, MAX_RANK, workers=2):
        taken.append((name, adapter.adapter_id))
        if len(taken) == 3:
            break
    assert taken == list(serial_ids(model, dict(list(items.items())[:3])).items())


def scan(root: Path, state: Path, model: ModelConfig) -> list:
    events: list = []
    core = RegistryCore(root, state, model, MAX_RANK, 512, TokenBucket(0.0, 1), events.append)
    core.on_changed(core.names_on_disk())
    registry_turn(core, 0.0)
    return events


def test_the_registry_scans_a_full_directory_in_one_batch(tiny, tmp_path, hash_calls):
    """A start-up scan validates its names together, snapshots exactly validated bytes, hits
    the cache on the next start, and a forged cache entry is caught by the snapshot's hash."""
    model, items = tiny
    root = tmp_path / "dir"
    chosen = dict(list(items.items())[:20])
    for name, path in chosen.items():
        shutil.copytree(path, root / name)
    (root / "a005" / "adapter_config.json").write_text("{")
    expected = serial_ids(model, {n: p for n, p in chosen.items() if n != "a005"})
    events = scan(root, tmp_path / "state1", model)
    assert [(e.kind, e.name) for e in events] == [
        ("rejected" if n == "a005" else "added", n) for n in chosen]
    added = {e.name: e for e in events if e.kind == "added"}
    assert {n: e.adapter_id for n, e in added.items()} == expected
    for event in added.values():
        snapshot = load_adapter(event.name, event.path, model, MAX_RANK)
        assert snapshot.adapter_id == event.adapter_id
    cache = HashCache()
    forged = adapter_stamp(root / "a007")
    cache.put(forged, "0" * 64)
    cache.save()
    hash_calls.clear()
    events = scan(root, tmp_path / "state2", model)
    assert {e.name: e.adapter_id for e in events if e.kind == "added"} == expected
    assert not hash_calls  # a005, invalid, is refused from its config: never read, hashed or cached


def test_the_worker_prefetches_within_its_time_budget(tmp_path):
    """Past its time budget the worker stops packing start-up adapters (the rest are read on
    first use); within it, every one is packed under the id the scheduler registers."""
    model, adapters = build_checkpoints(tmp_path)
    args = ServerArgs(model=str(model), adapters={k: str(v) for k, v in adapters.items()})
    assert prefetch_adapters(make_executor(args).runner, args, time_budget_s=0.0) == 1
    runner = make_executor(args).runner
    assert prefetch_adapters(runner, args) == len(adapters)
    scheduler = SchedulerService(sized(args))
    registered = {a.adapter_id for a in scheduler.adapters.by_name.values()}
    assert set(runner.adapter_pool.host.ids()) == registered


def test_the_cache_keeps_the_most_recently_validated(tmp_path, monkeypatch):
    monkeypatch.setattr(registration, "MAX_CACHE_ENTRIES", 3)
    path = tmp_path / CACHE_FILE
    first = HashCache(path)
    for key in "abcd":
        first.put(key, key * 64)
    first.save()
    second = HashCache(path)
    second.put("b", "e" * 64)
    second.save()
    assert list(HashCache(path).entries.items()) == [("c", "c" * 64), ("d", "d" * 64),
                                                     ("b", "e" * 64)]
