"""Hot-swap pieces without sockets or subprocesses: the token bucket, the registry's decisions
(validation, content hash, aliases, admission order and pace, restart), admin path
confinement, and the scheduler + worker services across re-publication, unload, the swap cap
and the base fallback, compared with the offline Engine and checked for leaked refs and rows."""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from radixlora import Engine, SamplingParams
from radixlora.config import ModelConfig
from radixlora.errors import AdapterError
from radixlora.lora.adapter import load_adapter
from radixlora.lora.host_cache import packed_name
from radixlora.lora.layout import load_bytes
from radixlora.sched.token_bucket import TokenBucket
from radixlora.server.args import ServerArgs
from radixlora.server.http.admin import confine
from radixlora.server.http.common import HttpError
from radixlora.server.messages import (
    AdapterChoice,
    AdapterEvent,
    AdminReq,
    TokenizedReq,
    bytes_to_ids,
    ids_to_bytes,
)
from radixlora.server.procs import adapter_store as store_module
from radixlora.server.procs.registry_proc import DirWatch, RegistryCore
from radixlora.server.procs.scheduler_proc import SchedulerService
from radixlora.server.procs.worker_proc import make_executor
from scripts.checkpoints import build_tiny_adapter, build_tiny_model
from tests.server_harness import batch_ended, registry_turn, sized
from tests.test_server_units import _drive

ENGINE = dict(kv_pages=200, max_running=8, adapter_rows=32)
PARAMS = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("hs") / "model")


@pytest.fixture(scope="module")
def versions(model, tmp_path_factory):
    root = tmp_path_factory.mktemp("versions")
    return {v: build_tiny_adapter(model, root / v, rank=4, seed=s)
            for v, s in (("v1", 1), ("v2", 2), ("v3", 3))}


def _core(model, root: Path, state: Path, rate=0.0, burst=1, now=0.0):
    events: list[AdapterEvent] = []
    core = RegistryCore(root, state, ModelConfig.from_dir(model), 64, 32,
                        TokenBucket(rate, burst, now=now), events.append)
    return core, events


def _copy(src: Path, dst: Path) -> Path:
    """The documented protocol: stage in .NAME.tmp, rename into place."""
    staging = dst.parent / f".{dst.name}.tmp"
    shutil.copytree(src, staging)
    os.rename(staging, dst)
    return dst


# ---- token bucket and registry decisions -------------------------------------------------------


def test_token_bucket_paces_and_bursts():
    bucket = TokenBucket(2.0, 3, now=0.0)
    assert bucket.available(0.0) == 3
    bucket.take(0.0, 3)
    assert bucket.available(0.0) == 0 and bucket.wait_s(0.0) == pytest.approx(0.5)
    assert bucket.available(0.5) == 1
    assert bucket.available(100.0) == 3  # never more than the burst


def test_admission_is_sorted_and_paced(model, versions, tmp_path):
    """Adapters that arrive while serving go through the bucket, in name order."""
    root = tmp_path / "dir"
    root.mkdir()
    names = [f"a{i:02d}" for i in range(12)]
    core, events = _core(model, root, tmp_path / "state", rate=4.0, burst=2)
    for i, name in enumerate(reversed(names)):
        build_tiny_adapter(model, root / name, rank=2, seed=100 + i)
    core.on_changed(sorted(core.names_on_disk(), reverse=True))
    admitted_at = {}
    for tick in range(0, 400):
        now = tick * 0.01
        before = len(events)
        registry_turn(core, now)
        for e in events[before:]:
            admitted_at[e.name] = now
    assert [e.name for e in events] == names and {e.kind for e in events} == {"added"}
    assert [e.seq for e in events] == list(range(1, 13))
    times = [admitted_at[n] for n in names]
    assert times[:2] == [0.0, 0.0]  # the burst
    assert times[-1] == pytest.approx(10 / 4.0, abs=0.02)  # then 4 per second


def test_a_full_directory_at_start_is_published_at_once(model, tmp_path, monkeypatch):
    """The adapters already in the directory when the registry starts skip the bucket (they
    are validated together, and published a few per loop turn so the registry beats between
    turns); one added later waits for a token."""
    from radixlora.server.procs import registry_proc

    monkeypatch.setattr(registry_proc, "PUBLISH_PER_CALL", 4)
    root = tmp_path / "dir"
    root.mkdir()
    for i in range(10):
        build_tiny_adapter(model, root / f"s{i}", rank=2, seed=200 + i)
    core, events = _core(model, root, tmp_path / "state", rate=1.0, burst=1)
    core.on_changed(core.names_on_disk())
    batch_ended(core)
    published = []
    for _ in range(3):
        registry_turn(core, 0.0)
        published.append(len(events))
    assert published == [4, 8, 10]
    assert sorted(e.name for e in events) == [f"s{i}" for i in range(10)]
    assert {e.kind for e in events} == {"added"}
    build_tiny_adapter(model, root / "late1", rank=2, seed=300)
    build_tiny_adapter(model, root / "late2", rank=2, seed=301)
    core.on_changed(["late1", "late2"])
    registry_turn(core, 0.0)
    assert [e.name for e in events[10:]] == ["late1"]  # the bucket's one token
    registry_turn(core, 1.0)
    assert [e.name for e in events[10:]] == ["late1", "late2"]


def test_the_directory_at_start_is_validated_while_subscribers_connect(model, tmp_path):
    """validate_ahead (called while the registry waits for its subscribers) validates the
    directory at start; publishing then uses those results, and one whose files change in
    between is validated again, so its event carries the content it has now."""
    root = tmp_path / "dir"
    root.mkdir()
    for i in range(3):
        build_tiny_adapter(model, root / f"p{i}", rank=2, seed=400 + i)
    (root / "broken").mkdir()
    core, events = _core(model, root, tmp_path / "state")
    batch_ended(core)
    assert not core.validate_ahead()
    assert sorted(core.prevalidated) == ["p0", "p1", "p2"] and not events
    ahead = {n: a.adapter_id for n, a in core.prevalidated.items()}
    build_tiny_adapter(model, root / "p1", rank=2, seed=500)  # changed after validation
    core.on_changed(core.names_on_disk())
    registry_turn(core, 0.0)
    published = {e.name: e.adapter_id for e in events if e.kind == "added"}
    assert published["p0"] == ahead["p0"] and published["p2"] == ahead["p2"]
    assert published["p1"] != ahead["p1"]
    assert [e.name for e in events if e.kind == "rejected"] == ["broken"]
    assert not core.prevalidated


def _write_bad(model, root: Path, versions) -> dict[str, str]:
    """One adapter per way validation must catch, each with the reason label expected."""
    good = versions["v1"]
    cases = {}

    def clone(name):
        shutil.copytree(good, root / name)
        return root / name

    def config(path, **changes):
        cfg = json.loads((path / "adapter_config.json").read_text())
        cfg.update(changes)
        (path / "adapter_config.json").write_text(json.dumps(cfg))

    (clone("no_config") / "adapter_config.json").unlink()
    cases["no_config"] = "missing_config"
    (clone("bad_json") / "adapter_config.json").write_text("{not json")
    cases["bad_json"] = "bad_config_json"
    for name, r in (("r_zero", 0), ("r_negative", -4), ("r_huge", 4096)):
        config(clone(name), r=r)
        cases[name] = "bad_rank"
    (clone("empty_weights") / "adapter_model.safetensors").write_bytes(b"")
    cases["empty_weights"] = "corrupted_weights"
    path = clone("truncated")
    data = (path / "adapter_model.safetensors").read_bytes()
    (path / "adapter_model.safetensors").write_bytes(data[: len(data) // 2])
    cases["truncated"] = "corrupted_weights"
    (clone("bad_header") / "adapter_model.safetensors").write_bytes(b"\xff" * 64)
    cases["bad_header"] = "corrupted_weights"
    path = clone("pickle_only")
    (path / "adapter_model.safetensors").rename(path / "adapter_model.bin")
    cases["pickle_only"] = "pickle_only"
    config(clone("dora"), use_dora=True)  # DoRA without its magnitude vectors
    cases["dora"] = "bad_dora"
    path = clone("wrong_shape")
    config(path, r=2)  # tensors are rank 4
    cases["wrong_shape"] = "shape_mismatch"
    path = clone("other_base")  # a layer the base model lacks (another architecture's adapter)
    tensors = load_file(path / "adapter_model.safetensors")
    save_file({k.replace("layers.0.", "layers.7."): v for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))
    cases["other_base"] = "incompatible_base"
    (root / ("x" * 200)).mkdir()
    cases["x" * 200] = "bad_name"
    return cases


def test_bad_adapters_are_rejected_with_reasons(model, versions, tmp_path):
    root = tmp_path / "dir"
    root.mkdir()
    cases = _write_bad(model, root, versions)
    _copy(versions["v1"], root / "good")
    core, events = _core(model, root, tmp_path / "state")
    core.on_changed(core.names_on_disk())
    registry_turn(core, 0.0)
    rejected = {e.name: e.reason for e in events if e.kind == "rejected"}
    for name, reason in cases.items():
        assert rejected.get(name) == reason, (name, rejected.get(name))
    assert [e.name for e in events if e.kind == "added"] == ["good"]
    assert all(e.message for e in events if e.kind == "rejected")


def test_a_directory_named_like_an_adapter_flag_is_rejected_unread(model, versions, tmp_path,
                                                                     monkeypatch):
    root = tmp_path / "dir"
    root.mkdir()
    for name in ("upper", "other"):
        _copy(versions["v1"], root / name)
    events: list[AdapterEvent] = []
    core = RegistryCore(root, tmp_path / "state", ModelConfig.from_dir(model), 64, 32,
                        TokenBucket(0.0, 1), events.append, taken=frozenset({"upper"}))
    read, reads = core._read, []
    monkeypatch.setattr(core, "_read", lambda name, pre: reads.append(name) or read(name, pre))
    core.on_changed(core.names_on_disk())
    registry_turn(core, 0.0)
    assert [(e.kind, e.name, e.reason) for e in events] == [("added", "other", ""),
                                                            ("rejected", "upper", "name_taken")]
    assert "--adapter" in events[1].message and reads == ["other"]


def test_a_huge_wrongly_shaped_directory_is_rejected_from_its_header(model, versions, tmp_path):
    """4 GiB declared (a sparse file) with wrong shapes, in the directory at start and added
    later: rejected for the cost of its header, the other adapter published."""
    import time

    from tests.server_harness import sparse_adapter

    root = tmp_path / "dir"
    root.mkdir()
    sparse_adapter(root / "huge", versions["v1"], gib=4)
    _copy(versions["v1"], root / "good")
    core, events = _core(model, root, tmp_path / "state", rate=100.0, burst=10)
    start = time.monotonic()
    core.on_changed(core.names_on_disk())
    registry_turn(core, 0.0)
    sparse_adapter(root / "later", versions["v1"], gib=4)
    core.on_changed(["later"])
    registry_turn(core, 1.0)
    assert time.monotonic() - start < 3.0
    assert [(e.kind, e.name, e.reason) for e in events] == [
        ("added", "good", ""), ("rejected", "huge", "shape_mismatch"),
        ("rejected", "later", "shape_mismatch")]


def test_a_name_too_slow_to_validate_is_refused_once_while_the_loop_beats(model, versions,
                                                                            tmp_path, monkeypatch):
    import threading

    from radixlora.server.procs import registry_proc

    monkeypatch.setattr(registry_proc, "VALIDATE_TIMEOUT_S", 0.4)
    monkeypatch.setattr(registry_proc, "BEAT_S", 0.05)
    root = tmp_path / "dir"
    root.mkdir()
    for name in ("good", "slow"):
        _copy(versions["v1" if name == "good" else "v2"], root / name)
    core, events = _core(model, root, tmp_path / "state", rate=100.0, burst=10)
    beats, release, reads = [], threading.Event(), []
    core.beat = lambda: beats.append(1)
    read = core._read

    def slow_read(name, pre):
        reads.append(name)
        if name == "slow":
            release.wait(10)
        return read(name, pre)

    monkeypatch.setattr(core, "_read", slow_read)
    core.on_changed(core.names_on_disk())
    registry_turn(core, 0.0)
    release.set()
    assert [(e.kind, e.name, e.reason) for e in events] == [
        ("added", "good", ""), ("rejected", "slow", "validation_timeout")]
    assert len(beats) >= 4
    core.on_changed(["slow"])  # unchanged: not examined again
    registry_turn(core, 1.0)
    assert len(events) == 2 and reads.count("slow") == 1
    shutil.rmtree(root / "slow")
    _copy(versions["v3"], root / "slow")  # its files changed: examined again
    core.on_changed(["slow"])
    registry_turn(core, 2.0)
    assert events[-1].kind == "added" and events[-1].name == "slow"


def test_a_start_up_batch_never_holds_the_loop_and_a_wanted_name_goes_first(
        model, versions, tmp_path, monkeypatch):
    """The directory at start is validated as batches on a thread: admit returns at once while
    a batch runs (the loop beats and takes wants meanwhile), publishes the batch once it ends,
    and a name a held request wants is examined ahead of all of them."""
    import threading

    from radixlora.server.procs import registry_proc

    root = tmp_path / "dir"
    root.mkdir()
    names = [f"a{k:02d}" for k in range(registry_proc.REGISTER_BATCH[0])]
    for name in names:
        _copy(versions["v1"], root / name)
    core, events = _core(model, root, tmp_path / "state")
    release = threading.Event()
    real = registry_proc.load_adapters

    def held_batch(*args, **kw):
        release.wait(10)
        return real(*args, **kw)

    monkeypatch.setattr(registry_proc, "load_adapters", held_batch)
    core.on_changed(core.names_on_disk())
    core.list_waiting()
    assert [(e.kind, e.names) for e in events] == [("listed", names)]
    core.admit(0.0)
    assert len(events) == 1 and core.ahead is not None  # the batch runs; admit returned
    core.want(names[-1])
    core.admit(0.0)
    assert [(e.kind, e.name) for e in events[1:]] == [("added", names[-1])]
    shutil.rmtree(root / names[0])  # listed, then gone before it was examined
    core.on_changed([names[0]])
    assert [(e.kind, e.name) for e in events[2:]] == [("removed", names[0])]
    release.set()
    batch_ended(core)
    for _ in range(3):
        core.admit(0.0)
    added = [e.name for e in events if e.kind == "added"]
    assert added == names[-1:] + names[1:-1] and not core.pending


def test_aliases_updates_removals_and_restart(model, versions, tmp_path):
    root, state = tmp_path / "dir", tmp_path / "state"
    root.mkdir()
    _copy(versions["v1"], root / "a")
    core, events = _core(model, root, state)
    core.on_changed(["a"])
    registry_turn(core, 0.0)
    _copy(versions["v1"], root / "b")  # same content, other name: an alias of a's version
    core.on_changed(["b"])
    registry_turn(core, 0.0)
    assert [(e.kind, e.name) for e in events] == [("added", "a"), ("added", "b")]
    assert (events[1].adapter_id, events[1].path) == (events[0].adapter_id, events[0].path)
    shutil.copy(versions["v2"] / "adapter_model.safetensors", root / "a")
    core.on_changed(["a"])
    registry_turn(core, 0.0)
    assert [(e.kind, e.name) for e in events[2:]] == [("updated", "a")]
    assert events[-1].adapter_id != events[0].adapter_id == core.active["b"].adapter_id
    assert Path(events[-1].path).parent == state / "adapters"  # an immutable snapshot
    published = {e.path for e in events if e.kind in ("added", "updated")}
    assert set(map(str, (state / "adapters").iterdir())) == published  # the alias wrote none
    shutil.rmtree(root / "a")
    core.on_changed(["a"])
    assert (events[-1].kind, events[-1].name) == ("removed", "a")
    # a restarted registry publishes only what changed while it was down, seq continuing
    _copy(versions["v3"], root / "c")
    core2, events2 = _core(model, root, state)
    core2.on_changed(sorted(set(core2.names_on_disk()) | set(core2.active)))
    registry_turn(core2, 0.0)
    assert [(e.kind, e.name) for e in events2] == [("added", "c")]
    assert events2[0].seq == events[-1].seq + 1


def test_half_written_adapter_is_never_published(model, versions, tmp_path):
    root = tmp_path / "dir"
    root.mkdir()
    target = root / "slow"
    target.mkdir()
    shutil.copy(versions["v1"] / "adapter_config.json", target)
    data = (versions["v1"] / "adapter_model.safetensors").read_bytes()
    (target / "adapter_model.safetensors").write_bytes(data[: len(data) // 3])
    core, events = _core(model, root, tmp_path / "state")
    core.on_changed(["slow"])
    registry_turn(core, 0.0)
    assert [e.kind for e in events] == ["rejected"] and events[0].reason == "corrupted_weights"
    (target / "adapter_model.safetensors").write_bytes(data)
    core.on_changed(["slow"])
    registry_turn(core, 0.0)
    assert events[-1].kind == "added"


def test_dir_watch_waits_for_quiet(tmp_path):
    watch = DirWatch(tmp_path)
    watch.touch(str(tmp_path / "a" / "adapter_config.json"))
    watch.touch(str(tmp_path / ".b.tmp" / "x"))  # staging directories are ignored
    now = watch.last_event
    assert watch.take_ready(now + 0.1, quiet_s=0.5) == []
    assert watch.take_ready(now + 0.6, quiet_s=0.5) == ["a"]
    assert watch.take_ready(now + 0.7, quiet_s=0.5) == []


# ---- admin path confinement ----------------------------------------------------------------------


def test_confine_refuses_escapes(tmp_path):
    root = tmp_path / "allowed"
    (root / "ok").mkdir(parents=True)
    (tmp_path / "secret").mkdir()
    os.symlink(tmp_path / "secret", root / "escape")
    assert confine(str(root / "ok"), [str(root)]) == os.path.realpath(root / "ok")
    assert confine("ok", [str(root)]) == os.path.realpath(root / "ok")
    for bad, status in ((str(root / ".." / "secret"), 400), ("../secret", 400),
                        (str(tmp_path / "secret"), 403), ("/etc", 403),
                        (str(root / "escape"), 403), ("", 400), ("a\0b", 400)):
        with pytest.raises(HttpError) as e:
            confine(bad, [str(root)])
        assert e.value.status == status, bad
    with pytest.raises(HttpError) as e:
        confine(str(root / "ok"), [])
    assert e.value.status == 403


# ---- scheduler + worker services -----------------------------------------------------------------


def _req(rid: str, name: str | None, prompt=(3, 4, 5, 6)) -> TokenizedReq:
    return TokenizedReq(rid=rid, input_ids=ids_to_bytes(list(prompt)), params=PARAMS,
                        adapters=[AdapterChoice(name)] if name else None)


def _services(model, tmp_path, **kw):
    args = ServerArgs(model=str(model), engine=ENGINE, state_dir=str(tmp_path), **kw)
    return SchedulerService(sized(args)), make_executor(args)


def _event(seq, kind, name, adapter=None):
    return AdapterEvent(seq=seq, kind=kind, name=name,
                        adapter_id=adapter.adapter_id if adapter else "",
                        path=adapter.path if adapter else "")


def _want(model, path, prompt=(3, 4, 5, 6)):
    engine = Engine(model, adapters={"x": path}, **ENGINE)
    return engine.generate(list(prompt), PARAMS, adapters="x")[0].outputs[0].token_ids


def _assert_nothing_held(service: SchedulerService) -> None:
    info = service.info()
    assert not info["open_requests"] and not info["adapter_retired"]
    assert all(refs == 0 for refs in info["adapter_refs"].values())
    used = sum(len(e.rows) for e in service.scheduler.residency.resident.values())
    assert info["adapter_rows_free"] + used == info["adapter_rows_total"]


def test_republished_name_in_flight_finishes_on_old_version(model, versions, tmp_path):
    from radixlora.server.procs.adapter_store import AdapterStore

    store = AdapterStore(tmp_path / "adapters")
    cfg = ModelConfig.from_dir(model)
    v1, v2 = (store.snapshot("a", versions[v], cfg, 64) for v in ("v1", "v2"))
    sched, worker = _services(model, tmp_path)
    sched.lifecycle.on_event(_event(1, "added", "a", v1))
    assert sched.add(_req("old", "a")) is None
    plan = sched.next_plan()  # "old" holds v1 now
    batch, _ = sched.on_result(worker.execute(plan))
    sched.lifecycle.on_event(_event(2, "updated", "a", v2))
    assert v1.adapter_id in sched.lifecycle.retired
    assert sched.scheduler.residency.refs(v1.adapter_id) == 1
    got = _drive(sched, worker, [_req("new", "a")])
    first = [int(t) for out in batch.outputs for t in bytes_to_ids(out.token_ids)]
    assert first + got[("old", 0)] == _want(model, versions["v1"])
    assert got[("new", 0)] == _want(model, versions["v2"])
    assert not sched.scheduler.residency.is_resident(v1.adapter_id)
    assert not Path(v1.path).exists() and Path(v2.path).is_dir()  # v1 forgotten, v2 named
    _assert_nothing_held(sched)


def test_a_request_for_a_listed_adapter_waits_for_that_adapter_alone(model, versions,
                                                                      tmp_path):
    """Names the registry listed before validating them: a request for one is held (the
    registry is asked for it) while others run, added when it is published, told why when it
    is rejected, and given up after HOLD_TIMEOUT_S; an unlisted name is a 404 at once."""
    from radixlora.server.messages import AbortReq
    from radixlora.server.procs import scheduler_proc
    from radixlora.server.procs.adapter_store import AdapterStore

    v1 = AdapterStore(tmp_path / "adapters").snapshot("a", versions["v1"],
                                                      ModelConfig.from_dir(model), 64)
    sched, worker = _services(model, tmp_path)
    assert sched.on_adapter_event(AdapterEvent(seq=1, kind="listed",
                                               names=["a", "bad", "slow"])) == []
    for rid, name in (("r1", "a"), ("r2", "bad"), ("r2b", "bad"), ("r3", "slow")):
        assert sched.add(_req(rid, name)) is None
    assert sched.take_wanted() == ["a", "bad", "slow"] and not sched.reqs
    assert sched.add(_req("r1", "a")).code == "duplicate_request_id"
    unknown = sched.add(_req("r4", "zzz"))
    assert unknown.status == 404 and "GET /v1/models" in unknown.message
    assert _drive(sched, worker, [_req("base", None)])[("base", 0)] == _want_base(model)
    assert sched.on_adapter_event(_event(2, "added", "a", v1)) == []
    assert list(sched.reqs) == ["r1"]
    got = _drive(sched, worker, [])
    assert got[("r1", 0)] == _want(model, versions["v1"])
    errors = sched.on_adapter_event(AdapterEvent(seq=3, kind="rejected", name="bad",
                                                 reason="bad_rank", message="rank 0 is bad"))
    assert [(e.rid, e.status) for e in errors] == [("r2", 404), ("r2b", 404)]
    assert "rejected: rank 0 is bad" in errors[0].message
    assert sched.add(_req("r5", "slow")) is None
    sched.abort(AbortReq(rid="r5"))
    late = sched.expire_held(time.monotonic() + scheduler_proc.HOLD_TIMEOUT_S + 1)
    assert [(e.rid, e.status, e.code) for e in late] == [("r3", 503, "adapter_not_ready")]
    assert not sched.held and not sched.held_rids
    _assert_nothing_held(sched)


def _want_base(model, prompt=(3, 4, 5, 6)):
    engine = Engine(model, **ENGINE)
    return engine.generate(list(prompt), PARAMS)[0].outputs[0].token_ids


def test_directory_events_never_replace_or_remove_an_adapter_flag_or_admin_load(model, versions,
                                                                                tmp_path):
    from radixlora.server.procs.adapter_store import AdapterStore

    store = AdapterStore(tmp_path / "adapters")
    cfg = ModelConfig.from_dir(model)
    v1, v2 = (store.snapshot("a", versions[v], cfg, 64) for v in ("v1", "v2"))
    sched, _ = _services(model, tmp_path, adapters={"flag": str(versions["v3"])})
    life = sched.lifecycle
    flag_id = life.registry.by_name["flag"].adapter_id
    life.on_event(_event(1, "added", "flag", v1))
    life.on_event(_event(2, "removed", "flag", v1))
    assert life.registry.by_name["flag"].adapter_id == flag_id
    life.on_event(_event(3, "added", "a", v1))  # the directory's "a", then an admin load
    reply = life.admin(AdminReq(qid=1, op="load", name="a", path=str(versions["v2"])))
    assert reply.status == 200, reply.message
    life.on_event(_event(4, "updated", "a", v1))
    life.on_event(_event(5, "removed", "a", v1))
    assert life.registry.by_name["a"].adapter_id == v2.adapter_id
    _assert_nothing_held(sched)


def test_non_finite_logits_fail_their_request_with_a_clear_error(model, versions, tmp_path):
    from radixlora.server.messages import Codec, SchedulerInbox, WorkerInbox

    sched, worker = _services(model, tmp_path, adapters={"x": str(versions["v1"])})
    _drive(sched, worker, [_req("warm", "x")])  # x resident in the worker's pool
    for layer in worker.runner.adapter_pool.b:
        for rows in layer.values():
            rows.fill_(1e30)
    to_worker, to_sched = Codec(WorkerInbox), Codec(SchedulerInbox)
    assert sched.add(_req("bad", "x")) is None and sched.add(_req("ok", None)) is None
    errors, tokens = [], {}
    while sched.scheduler.has_work():
        while (plan := sched.next_plan()) is not None:
            worker.submit(to_worker.decode(to_worker.encode(plan)))
        (result,) = worker.collect(keep=len(worker.in_flight) - 1)
        batch, errs = sched.on_result(to_sched.decode(to_sched.encode(result)))
        errors += errs
        for out in batch.outputs if batch else []:
            tokens.setdefault(out.rid, []).extend(bytes_to_ids(out.token_ids))
    assert [(e.rid, e.code, e.status) for e in errors] == [("bad", "non_finite_logits", 500)]
    assert "not finite" in errors[0].message
    assert len(tokens["ok"]) == PARAMS.max_tokens
    _assert_nothing_held(sched)


class _Sent:
    def __init__(self):
        self.msgs = []

    def send(self, msg):
        self.msgs.append(msg)


def _admin_loop(service):
    from concurrent.futures import ThreadPoolExecutor

    from radixlora.server.procs.scheduler_proc import SchedulerLoop

    loop = SchedulerLoop.__new__(SchedulerLoop)  # the admin queue alone, no sockets
    loop.service, loop.to_api = service, _Sent()
    loop.admin_queue = collections.deque()
    loop.admin_reads = ThreadPoolExecutor(1)
    return loop


def test_admin_loads_read_off_the_loop_and_apply_in_order(model, versions, tmp_path,
                                                          monkeypatch):
    """A load's files are read on a thread while the loop goes on planning steps; calls
    queued behind it (an unload of the same name) wait for it; a full queue answers 429."""
    import threading

    from radixlora.server.procs import scheduler_proc

    sched, worker = _services(model, tmp_path)
    loop = _admin_loop(sched)
    gate = threading.Event()
    read_load = sched.lifecycle.read_load
    monkeypatch.setattr(sched.lifecycle, "read_load",
                        lambda name, path: gate.wait(30) and read_load(name, path))
    loop.queue_admin(AdminReq(qid=1, op="load", name="a", path=str(versions["v1"])))
    loop.queue_admin(AdminReq(qid=2, op="unload", name="a"))
    monkeypatch.setattr(scheduler_proc, "MAX_QUEUED_ADMIN", 2)
    loop.queue_admin(AdminReq(qid=3, op="pin", name="a"))
    assert [(r.qid, r.status, r.code) for r in loop.to_api.msgs] == [(3, 429, "admin_queue_full")]
    got = _drive(sched, worker, [_req("meanwhile", None)])  # steps run while the read waits
    assert len(got[("meanwhile", 0)]) == PARAMS.max_tokens
    loop.apply_admin()
    assert len(loop.to_api.msgs) == 1 and "a" not in sched.lifecycle.registry.by_name
    gate.set()
    loop.admin_queue[0][1].result(30)
    loop.apply_admin()
    assert [(r.qid, r.status) for r in loop.to_api.msgs[1:]] == [(1, 200), (2, 200)]
    assert "a" not in sched.lifecycle.registry.by_name  # loaded, then unloaded, in order
    _assert_nothing_held(sched)


def test_published_snapshots_register_from_their_headers(model, versions, tmp_path,
                                                         monkeypatch):
    """A snapshot of the scheduler's own store, published with its id (the registry validated
    it whole), registers from its config and header alone; the worker still reads and
    re-hashes it, and serves its weights."""
    sched, worker = _services(model, tmp_path)
    snapshot = sched.lifecycle.store.snapshot("a", versions["v1"], ModelConfig.from_dir(model), 64)

    def full_validation(*args, **kwargs):
        raise AssertionError("the published snapshot was validated again")

    monkeypatch.setattr("radixlora.sched.adapter_registry.load_adapter", full_validation)
    sched.lifecycle.on_event(_event(1, "added", "a", snapshot))
    assert sched.adapters.by_name["a"].adapter_id == snapshot.adapter_id
    got = _drive(sched, worker, [_req("r", "a")])
    assert got[("r", 0)] == _want(model, versions["v1"])
    _assert_nothing_held(sched)


def test_an_admin_load_whose_files_change_while_read_is_409(model, versions, tmp_path,
                                                              monkeypatch):
    """A scan race: the adapter's files are rewritten while an admin load reads them. The load
    answers 409 adapter_changing and registers nothing; the same call once the files are still
    loads."""
    src = tmp_path / "src"
    shutil.copytree(versions["v1"], src)
    sched, _ = _services(model, tmp_path / "state")
    real = store_module.read_adapter_files

    def rewritten_while_read(name, path, roots=()):
        out = real(name, path, roots)
        config = Path(path) / "adapter_config.json"
        config.write_text(config.read_text() + " ")
        return out

    monkeypatch.setattr(store_module, "read_adapter_files", rewritten_while_read)
    reply = sched.lifecycle.admin(AdminReq(qid=1, op="load", name="a", path=str(src)))
    assert (reply.status, reply.code) == (409, "adapter_changing"), reply
    assert "a" not in sched.adapters.by_name
    monkeypatch.setattr(store_module, "read_adapter_files", real)
    reply = sched.lifecycle.admin(AdminReq(qid=2, op="load", name="a", path=str(src)))
    assert reply.status == 200 and "a" in sched.adapters.by_name
    _assert_nothing_held(sched)


def test_unload_while_in_use_waits_and_frees(model, versions, tmp_path):
    sched, worker = _services(model, tmp_path)
    reply = sched.lifecycle.admin(AdminReq(qid=1, op="load", name="a", path=str(versions["v3"])))
    assert reply.status == 200
    assert sched.add(_req("busy", "a")) is None
    plan = sched.next_plan()
    sched.on_result(worker.execute(plan))
    snapshot = Path(sched.adapters.by_name["a"].path)
    reply = sched.lifecycle.admin(AdminReq(qid=2, op="unload", name="a"))
    assert reply.status == 200 and reply.info["in_flight"] is True
    assert sched.add(_req("late", "a")) is not None  # unknown now: 404
    assert snapshot.is_dir()  # "busy" still uses it
    got = _drive(sched, worker, [])
    assert not snapshot.exists()
    assert len(got[("busy", 0)]) == PARAMS.max_tokens - 1
    assert sched.lifecycle.admin(AdminReq(qid=3, op="unload", name="a")).status == 404
    _assert_nothing_held(sched)
    assert not sched.scheduler.residency.resident


def test_snapshot_outlives_the_step_that_loads_it(model, versions, tmp_path):
    from radixlora.server.messages import AbortReq

    sched, worker = _services(model, tmp_path)
    assert sched.lifecycle.admin(AdminReq(qid=1, op="load", name="a",
                                          path=str(versions["v1"]))).status == 200
    snapshot = Path(sched.adapters.by_name["a"].path)
    assert sched.add(_req("r", "a")) is None
    plan = sched.next_plan()  # loads "a" from its snapshot
    assert sched.lifecycle.admin(AdminReq(qid=2, op="unload", name="a")).status == 200
    sched.abort(AbortReq(rid="r"))
    assert snapshot.is_dir()  # no request uses it, but the worker has yet to read it
    result = worker.execute(plan)
    assert not result.failed_adapters
    sched.on_result(result)
    assert not snapshot.exists()
    _assert_nothing_held(sched)
    assert not sched.scheduler.residency.resident


def test_version_that_fails_to_load_is_forgotten(model, versions, tmp_path):
    """The worker finds a snapshot that no longer hashes to its id (and no packed file): the
    requests on it fail, its name, rows and snapshot are gone, and the service serves the next
    version."""
    sched, worker = _services(model, tmp_path)
    assert sched.lifecycle.admin(AdminReq(qid=1, op="load", name="a",
                                          path=str(versions["v1"]))).status == 200
    snapshot = Path(sched.adapters.by_name["a"].path)
    for packed in snapshot.glob(packed_name("*")):
        packed.unlink()
    for f in versions["v2"].iterdir():  # same shapes, other weights
        shutil.copy(f, snapshot / f.name)
    assert sched.add(_req("r", "a")) is None
    result = worker.execute(sched.next_plan())
    assert result.failed_adapters
    _, errors = sched.on_result(result)
    assert [e.code for e in errors] == ["adapter_load_failed"]
    assert "a" not in sched.adapters.by_name and not snapshot.exists()
    _assert_nothing_held(sched)
    assert sched.lifecycle.admin(AdminReq(qid=2, op="load", name="a",
                                          path=str(versions["v2"]))).status == 200
    got = _drive(sched, worker, [_req("again", "a")])
    assert got[("again", 0)] == _want(model, versions["v2"])


def test_more_adapters_than_pool_rows_queue_under_the_swap_cap(model, tmp_path):
    names = [f"n{i}" for i in range(10)]  # 10 x rank 8 rows, the pool holds 32
    sched, worker = _services(model, tmp_path, max_swaps_per_s=50.0)
    for i, name in enumerate(names):
        path = build_tiny_adapter(model, tmp_path / "src" / name, rank=8, seed=20 + i)
        reply = sched.lifecycle.admin(AdminReq(qid=i, op="load", name=name, path=str(path)))
        assert reply.status == 200
    assert sched.lifecycle.admin(AdminReq(qid=99, op="pin", name="n0")).status == 200
    assert sched.lifecycle.admin(AdminReq(qid=98, op="pin", name="n1")).status == 200
    assert sched.lifecycle.admin(AdminReq(qid=97, op="pin", name="n2")).code == "pin_limit"
    got = _drive(sched, worker, [_req(f"r{i}", n) for i, n in enumerate(names)])
    assert all(len(got[(f"r{i}", 0)]) == PARAMS.max_tokens for i in range(len(names)))
    assert sched.num_loads >= len(names)
    assert sched.scheduler.residency.is_resident(sched.adapters.by_name["n0"].adapter_id)
    _assert_nothing_held(sched)


def test_base_fallback_says_so(model, tmp_path):
    sched, worker = _services(model, tmp_path, adapter_failure_policy="base")
    assert sched.add(_req("fb", "missing")) is None
    plan = sched.next_plan()
    batch, _ = sched.on_result(worker.execute(plan))
    assert "missing" in batch.outputs[0].fallback
    strict, _ = _services(model, tmp_path / "strict")
    assert strict.add(_req("fb", "missing")).status == 404


def test_fallback_reaches_the_response(model, tmp_path):
    from radixlora.server.http.bridge import Generation
    from radixlora.server.http.openai_api import FALLBACK_HEADER, fallback_response
    from radixlora.server.messages import GenerateReq, TokenBatch, TokenOut
    from radixlora.server.procs.tokenizer_proc import TokenizerService

    tokenizer = TokenizerService(sized(ServerArgs(model=str(model))))
    tokenizer.on_generate(GenerateReq(rid="f", params=PARAMS, prompt="x"))
    out = TokenOut(rid="f", index=0, token_ids=ids_to_bytes([5]), logprobs=[0.0], top=None,
                   finish_reason=None, prompt_tokens=1, cached_tokens=0, fallback="why")
    _, batches = tokenizer.on_tokens(TokenBatch(outputs=[out]))
    assert batches[0].outputs[0].fallback == "why"
    gen = Generation(GenerateReq(rid="f", params=PARAMS, prompt="x"), "a")
    plain = asyncio.run(fallback_response(lambda: {"id": "f"}, [gen]))
    assert FALLBACK_HEADER not in plain.headers and b"system_fingerprint" not in plain.body
    gen.fallback = "why"
    resp = asyncio.run(fallback_response(lambda: {"id": "f"}, [gen]))
    assert resp.headers[FALLBACK_HEADER] == "base"
    body = json.loads(resp.body)
    assert body["system_fingerprint"] == "radixlora-base-fallback"
    assert body["adapter_fallback"] == "why"


def test_worker_host_tier_is_one_bounded_lru_of_packed_adapters(model, versions, tmp_path):
    from radixlora.step_plan import AdapterLoad

    cfg = ModelConfig.from_dir(model)
    adapters = {v: load_adapter(v, p, cfg, 64) for v, p in versions.items()}
    probe = make_executor(ServerArgs(model=str(model), engine=ENGINE)).runner.adapter_pool
    size = probe.pack(adapters["v1"]).nbytes  # all three have rank 4
    # the swap cap's cost is these bytes: only the groups (and group ranks) the adapter has
    assert size == load_bytes(cfg, probe.dtype, adapters["v1"].group_ranks)
    worker = make_executor(ServerArgs(model=str(model),
                                      engine={**ENGINE, "host_adapter_bytes": 2 * size}))
    host = worker.runner.adapter_pool.host

    def load(v, adapter_id=None):
        a = adapters[v]
        return worker.reader._packed(AdapterLoad(adapter_id or a.adapter_id, v, a.path,
                                                ids_to_bytes([0])))

    for v in ("v1", "v2", "v1", "v3"):  # v1 used again: v2 is the least recent
        load(v)
    assert host.ids() == [adapters["v1"].adapter_id, adapters["v3"].adapter_id]
    assert host.nbytes == 2 * size
    with pytest.raises(AdapterError, match="content hash differs"):
        load("v2", adapter_id=adapters["v1"].adapter_id[::-1])
    # the offline Engine loads through the same tier: a reload does not pack again
    engine = Engine(model, adapters={"x": versions["v1"]}, **ENGINE)
    engine.generate([3, 4], PARAMS, adapters="x")
    assert engine.runner.adapter_pool.host.ids() == [adapters["v1"].adapter_id]


def test_host_cache_keeps_the_newest_whatever_its_size():
    import torch

    from radixlora.lora.host_cache import HostAdapterCache, PackedAdapter

    def packed(name, floats):
        return PackedAdapter(name, {"qkv": 1}, torch.zeros(floats))

    cache = HostAdapterCache(budget_bytes=100, pin=False)
    cache.put(packed("small", 10))
    cache.put(packed("huge", 1000))  # over budget alone: kept, the older one goes
    assert cache.ids() == ["huge"] and cache.nbytes == 4000
    cache.put(packed("small", 10))
    assert cache.ids() == ["small"] and cache.nbytes == 40
    cache.put(packed("small", 20))  # the same id again replaces, never counts twice
    assert cache.nbytes == 80 and len(cache) == 1
    with pytest.raises(ValueError):
        HostAdapterCache(budget_bytes=-1, pin=False)


def test_unreadable_adapter_is_rejected_not_fatal(model, versions, tmp_path, monkeypatch):
    from radixlora.server.procs import adapter_store, registry_proc

    root = tmp_path / "dir"
    root.mkdir()
    _copy(versions["v1"], root / "gone")

    def vanished(name, path, roots=()):
        raise FileNotFoundError(f"{path} vanished")

    monkeypatch.setattr(adapter_store, "read_adapter_files", vanished)
    monkeypatch.setattr(registry_proc, "read_adapter_files", vanished)
    core, events = _core(model, root, tmp_path / "state")
    core.on_changed(["gone"])
    registry_turn(core, 0.0)
    assert [(e.kind, e.reason) for e in events] == [("rejected", "unreadable")]


def _fifo_weights(path: Path) -> None:
    (path / "adapter_model.safetensors").unlink()
    os.mkfifo(path / "adapter_model.safetensors")


def _int_weights(path: Path) -> None:
    tensors = load_file(path / "adapter_model.safetensors")
    save_file({k: v.to(torch.int32) for k, v in tensors.items()},
              str(path / "adapter_model.safetensors"))


def test_content_rules_reject_and_the_registry_goes_on(model, versions, tmp_path, monkeypatch):
    """Special files, integer tensors, the base's name and an unexpected exception are each a
    rejected event; the adapters after them are published."""
    root = tmp_path / "dir"
    root.mkdir()
    for name in ("a_fifo", "b_int", "base", "c_boom", "d_string_alpha", "z_good"):
        _copy(versions["v1"], root / name)
    _fifo_weights(root / "a_fifo")
    _int_weights(root / "b_int")
    cfg = json.loads((root / "d_string_alpha" / "adapter_config.json").read_text())
    (root / "d_string_alpha" / "adapter_config.json").write_text(
        json.dumps({**cfg, "lora_alpha": "16"}))
    events: list[AdapterEvent] = []
    core = RegistryCore(root, tmp_path / "state", ModelConfig.from_dir(model), 64, 32,
                        TokenBucket(0.0, 1), events.append, reserved=frozenset({"base"}))
    real = core.store.save

    def boom(validated):
        if validated.adapter.name == "c_boom":
            raise TypeError("unexpected")
        return real(validated)

    monkeypatch.setattr(core.store, "save", boom)
    core.on_changed(core.names_on_disk())
    registry_turn(core, 0.0)
    assert [(e.kind, e.name, e.reason) for e in events] == [
        ("rejected", "a_fifo", "special_file"), ("rejected", "b_int", "non_float_weights"),
        ("rejected", "base", "bad_name"), ("rejected", "c_boom", "invalid_adapter"),
        ("rejected", "d_string_alpha", "bad_config"), ("added", "z_good", "")]
    assert "`$.lora_alpha`" in events[4].message


def test_admin_loads_confine_every_file_and_alias_content(model, versions, tmp_path):
    """With allowed roots, a file symlink leaving them is a 403; a bad config, an int tensor
    and the base's name are 400s naming why; the same content under two names is one
    identity and one pool copy, both names generating the same tokens."""
    allowed = tmp_path / "allowed"
    allowed.mkdir()
    sched, worker = _services(model, tmp_path / "state", served_model_name="base",
                              allowed_adapter_roots=[str(allowed)])
    escape = allowed / "escape"
    escape.mkdir()
    shutil.copy(versions["v1"] / "adapter_config.json", escape)
    os.symlink(versions["v1"] / "adapter_model.safetensors",
               escape / "adapter_model.safetensors")
    alpha = _copy(versions["v1"], allowed / "alpha")
    cfg = json.loads((alpha / "adapter_config.json").read_text())
    (alpha / "adapter_config.json").write_text(json.dumps({**cfg, "lora_alpha": "16"}))
    _int_weights(_copy(versions["v1"], allowed / "ints"))

    def load(name, path):
        return sched.lifecycle.admin(AdminReq(qid=1, op="load", name=name, path=str(path)))

    assert (load("e", escape).status, load("e", escape).code) == (403, "path_not_allowed")
    reply = load("alpha", alpha)
    assert reply.status == 400 and "`$.lora_alpha`" in reply.message
    assert load("ints", allowed / "ints").status == 400
    _copy(versions["v2"], allowed / "v2")
    assert "served model" in load("base", allowed / "v2").message
    for name in ("one", "two"):
        _copy(versions["v2"], allowed / name)
        assert load(name, allowed / name).status == 200
    assert set(sched.adapters.by_name) == {"one", "two"}
    one, two = (sched.adapters.by_name[n] for n in ("one", "two"))
    assert one.adapter_id == two.adapter_id
    got = _drive(sched, worker, [_req("r1", "one"), _req("r2", "two")])
    assert got[("r1", 0)] == got[("r2", 0)]
    assert list(sched.scheduler.residency.resident) == [one.adapter_id]
    assert sched.lifecycle.admin(AdminReq(qid=2, op="unload", name="one")).status == 200
    assert not sched.lifecycle.retired  # "two" still names it
    assert _drive(sched, worker, [_req("r3", "two")])[("r3", 0)] == got[("r1", 0)]
    _assert_nothing_held(sched)


def test_registered_adapters_are_read_into_the_host_tier_ahead_of_need(model, tmp_path):
    """Plans carry the registered adapters as host_reads: the worker reads them in the
    background while its host tier has room (never evicting for them), so a later load is a
    copy from host memory; a request on one still gives its own tokens."""
    import time

    names = [f"w{i}" for i in range(6)]
    paths = {n: build_tiny_adapter(model, tmp_path / "src" / n, rank=4, seed=40 + i)
             for i, n in enumerate(names)}
    cfg = ModelConfig.from_dir(model)
    dtype = ServerArgs(model=str(model)).engine_config().torch_dtype(cfg)
    size = load_bytes(cfg, dtype, load_adapter("w0", paths["w0"], cfg,
                                                           64).group_ranks)
    engine = {**ENGINE, "host_adapter_bytes": 4 * size}
    args = ServerArgs(model=str(model), engine=engine, state_dir=str(tmp_path / "state"),
                      adapters=paths)
    sched, worker = SchedulerService(sized(args)), make_executor(args)
    host = worker.runner.adapter_pool.host
    _drive(sched, worker, [_req("first", "w5")])
    assert sorted(sched.warm_sent) == sorted(sched.adapters.by_name[n].adapter_id
                                             for n in names[:4])  # the budget: four
    deadline = time.monotonic() + 30
    while worker.reader.warming and time.monotonic() < deadline:
        time.sleep(0.05)
    got = _drive(sched, worker, [_req("second", "w2")])
    ids = {n: sched.adapters.by_name[n].adapter_id for n in names}
    assert len(host.ids()) == 4 and host.nbytes <= 4 * size
    # w5 and w2 were loaded for requests; w0, w1 and w3 were only ever read ahead
    assert len(set(host.ids()) & {ids["w0"], ids["w1"], ids["w3"]}) >= 2
    assert got[("second", 0)] == _want(model, paths["w2"])
    _assert_nothing_held(sched)


def test_adapters_outside_the_target_modules_are_served_but_not_pinned(model, tmp_path):
    """A pool sized for q/k/v/o (max_rank 8: 9 rows on the MLP groups): an adapter on every
    module loads and answers as the Engine does, but pinning it would hold more than half of
    those 9 rows; a request stacking two of them is a 400 naming the flag."""
    engine = {**ENGINE, "max_rank": 8, "lora_target_modules": ["q_proj", "k_proj", "v_proj",
                                                               "o_proj"]}
    args = ServerArgs(model=str(model), engine=engine, state_dir=str(tmp_path))
    sched, worker = SchedulerService(sized(args)), make_executor(args)
    assert sched.scheduler.residency.rows.low == 9
    paths = {n: build_tiny_adapter(model, tmp_path / "src" / n, rank=8, seed=40 + i)
             for i, n in enumerate(("m0", "m1"))}
    for i, (name, path) in enumerate(paths.items()):
        reply = sched.lifecycle.admin(AdminReq(qid=i, op="load", name=name, path=str(path)))
        assert reply.status == 200
    reply = sched.lifecycle.admin(AdminReq(qid=9, op="pin", name="m0"))
    assert reply.code == "pin_limit" and "--lora-target-modules" in reply.message
    got = _drive(sched, worker, [_req("r0", "m0"), _req("r1", "m1")])
    assert got[("r0", 0)] == _want(model, paths["m0"])
    assert got[("r1", 0)] == _want(model, paths["m1"])
    stacked = TokenizedReq(rid="both", input_ids=ids_to_bytes([3, 4]), params=PARAMS,
                           adapters=[AdapterChoice("m0"), AdapterChoice("m1")])
    error = sched.add(stacked)
    assert error is not None and "--lora-target-modules" in error.message
    _assert_nothing_held(sched)
