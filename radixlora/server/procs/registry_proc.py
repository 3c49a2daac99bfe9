"""The registry process: watches --adapter-dir with watchdog and publishes ordered AdapterEvents
(XPUB, ipc://) to the scheduler and the api. An adapter is a sub-directory named after it.

What is published, in this order for each changed sub-directory (sorted by name):
  1. the directory must have been quiet (no file event anywhere in --adapter-dir) for
     --adapter-quiet-s, and its files' (size, mtime) must not change while it is read;
  2. it is validated (load_adapter) and identified by its content hash;
  3. content equal to the name's current version is skipped (unchanged); content already
     published under another name is an alias: published under this name too, pointing to
     that name's snapshot (one identity, one pool copy, one cache namespace);
  4. it waits for a token of the admission bucket (--adapter-rate per second, --adapter-burst;
     not the adapters already in the directory when the registry starts), is copied into a
     new immutable snapshot (an alias re-uses its twin's), and published (added / updated).
The names found at start are published at once as "listed" (the api lists them, the scheduler
holds a request for one until its outcome); a scheduler holding such a request sends the name
as AdapterWanted, and it is examined ahead of the others.
A deleted sub-directory is published as removed at once; an invalid one as rejected with a
reason label, its previous valid version (if any) staying active; whatever an adapter's
content, examining it never raises. Names starting with "." are
ignored: writers stage an adapter in `.NAME.tmp/` and rename it to `NAME/` (atomic on one file
system), which never exposes a partial adapter. The published set and the sequence number are
saved in STATE_DIR, so a restarted registry publishes only what changed while it was down."""

from __future__ import annotations

import collections
import contextlib
import functools
import logging
import math
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path

import msgspec
import zmq
from watchdog.events import FileSystemEventHandler
from watchdog.observers import Observer

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError, InvalidRequestError
from radixlora.lora.adapter import CHANGING, LoraAdapter, content_hash, read_adapter_files
from radixlora.lora.layout import PoolLayout, pool_layouts
from radixlora.lora.registration import HashCache, load_adapters
from radixlora.sched.adapter_choice import check_adapter_name
from radixlora.sched.token_bucket import TokenBucket
from radixlora.server.args import ServerArgs
from radixlora.server.ipc import (
    Heartbeats,
    Inbox,
    check_local,
    child_main,
    send_ready,
    serve_forever,
)
from radixlora.server.messages import AdapterEvent, AdapterWanted
from radixlora.server.procs.adapter_store import (
    SNAPSHOTS,
    AdapterStore,
    FilesChanged,
    Validated,
    file_signature,
    pack_target,
)

log = logging.getLogger(__spec__.name)  # the module's name also when run with -m

TICK_S = 0.02
TICK_MS = int(TICK_S * 1000)
MAX_DIRTY_S = 10.0  # a directory that never goes quiet is still examined this often
SUBSCRIBE_TIMEOUT_S = 60.0
# names validated together when the bucket has tokens for them: at least the first (fewer are
# not worth reading twice, once to validate and once to snapshot), at most the second
REGISTER_BATCH = (16, 256)
# names examined (re-read, hashed against their validation, snapshotted, published) per loop
# turn: the loop beats between turns, and one name takes up to ~40 ms for 14 MB on an H200 host
PUBLISH_PER_CALL = 32
PUBLISH_READERS = 8  # threads reading and hashing a turn's names
# A name whose read and validation take longer is rejected (validation_timeout) and not
# examined again until its files change; the loop beats every BEAT_S while it waits.
VALIDATE_TIMEOUT_S = 60.0
BEAT_S = 0.5

REJECT_REASONS = (  # (substring of the AdapterError, label), first match wins
    ("could not be validated within", "validation_timeout"),
    ("served from --adapter", "name_taken"),
    ("served on a", "quantization_mismatch"),
    ("lora_magnitude_vector", "bad_dora"),
    ("at `$.r`", "bad_rank"),
    ("at `$.rank_pattern", "bad_rank"),
    ("invalid field", "bad_config"),
    ("regular expression", "bad_config"),
    ("longer than", "bad_config"),
    ("has more than", "bad_config"),
    ("not a regular file", "special_file"),
    ("larger than", "too_large"),
    ("unreadable", "unreadable"),
    ("outside the allowed", "path_not_allowed"),
    ("served model", "bad_name"),
    ("floating point", "non_float_weights"),
    ("does not exist", "missing_directory"),
    ("no adapter_config.json", "missing_config"),
    ("not valid JSON", "bad_config_json"),
    ("must hold a JSON object", "bad_config_json"),
    ("pickle", "pickle_only"),
    ("no adapter_model.safetensors", "missing_weights"),
    ("is empty", "corrupted_weights"),
    ("corrupted", "corrupted_weights"),
    ("rank", "bad_rank"),
    ("shape mismatch", "shape_mismatch"),
    ("not supported", "unsupported_feature"),
    ("layers", "incompatible_base"),
    ("not a LoRA weight", "incompatible_base"),
    ("NaN", "non_finite_weights"),
    ("norm overflows", "overflowing_weights"),
)


def reject_reason(message: str) -> str:
    for needle, label in REJECT_REASONS:
        if needle in message:
            return label
    return "invalid_adapter"


class DirWatch:
    """Names of the sub-directories that changed, fed by watchdog's thread."""

    def __init__(self, root: Path):
        self.root = root
        self.lock = threading.Lock()
        self.dirty: dict[str, float] = {}  # name -> time of its first unexamined event
        self.last_event = 0.0

    def touch(self, path: str | bytes) -> None:
        rel = Path(os.fsdecode(path)).relative_to(self.root) if path else Path()
        if not rel.parts or rel.parts[0].startswith("."):
            return
        now = time.monotonic()
        with self.lock:
            self.dirty.setdefault(rel.parts[0], now)
            self.last_event = now

    def mark(self, names) -> None:
        now = time.monotonic()
        with self.lock:
            for name in names:
                self.dirty.setdefault(name, now)

    def take_ready(self, now: float, quiet_s: float) -> list[str]:
        """Sorted names to examine: all of them once the directory is quiet, else those dirty
        for longer than MAX_DIRTY_S."""
        with self.lock:
            if now - self.last_event >= quiet_s:
                names = list(self.dirty)
            else:
                names = [n for n, t in self.dirty.items() if now - t >= MAX_DIRTY_S]
            for name in names:
                del self.dirty[name]
        return sorted(names)


class _Handler(FileSystemEventHandler):
    def __init__(self, watch: DirWatch):
        self.watch = watch

    def on_any_event(self, event) -> None:
        if event.event_type in ("opened", "closed_no_write"):
            return
        for path in (event.src_path, getattr(event, "dest_path", "")):
            with contextlib.suppress(ValueError):  # outside the root (a move out of it)
                self.watch.touch(path)


class Published(msgspec.Struct, array_like=True):
    adapter_id: str
    path: str


class RegistryState(msgspec.Struct):
    seq: int = 0
    active: dict[str, Published] = {}


class RegistryCore:
    """The registry's decisions without sockets or threads: names in, AdapterEvents out."""

    def __init__(self, root: Path, state_dir: Path, model_cfg: ModelConfig, max_rank: int,
                 pool_rows: int, bucket: TokenBucket, publish: Callable[[AdapterEvent], None],
                 reserved: frozenset[str] = frozenset(), layouts: tuple[PoolLayout, ...] = (),
                 taken: frozenset[str] = frozenset()):
        """layouts: the workers' adapter pool layouts, which every snapshot holds the adapter
        packed for (none: the workers pack adapters themselves); taken: the names of the
        --adapter adapters, which a sub-directory of the same name never replaces (it is
        rejected, unread)."""
        self.root = root
        self.reserved = reserved
        self.taken = taken
        self.store = AdapterStore(state_dir / SNAPSHOTS, pack_target(state_dir, layouts))
        self.state_path = state_dir / "registry_state.json"
        self.model_cfg = model_cfg
        self.max_rank = max_rank
        self.pool_rows = pool_rows
        self.bucket = bucket
        self.publish = publish
        self.state = self._load_state()
        self.pending: set[str] = set()
        # in the directory when the registry started: published without the admission bucket,
        # which paces adapters that arrive while serving
        self.at_start: set[str] = set(self.names_on_disk()) if root.is_dir() else set()
        self.retry: list[str] = []  # names whose files changed while read
        self.counts: collections.Counter = collections.Counter()
        self.cache = HashCache()
        self.prevalidated: dict[str, LoraAdapter] = {}  # at-start names validated ahead
        self.readers = ThreadPoolExecutor(PUBLISH_READERS, thread_name_prefix="registry-read")
        self.batches = ThreadPoolExecutor(1, thread_name_prefix="registry-batch")
        self.tried_ahead: set[str] = set()
        self.ahead: Future | None = None  # the batch validate_ahead is validating
        self.ahead_names: set[str] = set()  # its names
        self.wanted: set[str] = set()  # listed names a request waits for: examined first
        self.too_slow: dict[str, tuple] = {}  # name -> file signature that timed out
        self.rejected: set[str] = set()  # names whose latest version was rejected
        self.beat: Callable[[], None] = lambda: None  # the loop's heartbeat, while it waits

    @property
    def active(self) -> dict[str, Published]:
        return self.state.active

    def _load_state(self) -> RegistryState:
        if self.state_path.is_file():
            return msgspec.json.decode(self.state_path.read_bytes(), type=RegistryState)
        return RegistryState(active={})

    def _save_state(self) -> None:
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_bytes(msgspec.json.encode(self.state))
        os.replace(tmp, self.state_path)

    def names_on_disk(self) -> list[str]:
        return sorted(e.name for e in os.scandir(self.root) if not e.name.startswith("."))

    def on_changed(self, names: list[str]) -> None:
        for name in names:
            if (self.root / name).is_dir():
                slow = self.too_slow.get(name)
                if slow is not None and slow == self._signature(name):
                    continue  # timed out as it is: examined again once its files change
                self.pending.add(name)
            else:
                self.pending.discard(name)
                if name in self.active:
                    self._remove(name)
                elif name in self.rejected:  # the subscribers stop reporting its rejection
                    self.rejected.discard(name)
                    self._emit("removed", name)
                elif name in self.at_start:  # listed, gone before it was examined
                    self.at_start.discard(name)
                    self.wanted.discard(name)
                    self._emit("removed", name)

    def _remove(self, name: str) -> None:
        adapter_id = self.active.pop(name).adapter_id
        self._emit("removed", name, adapter_id=adapter_id)

    def list_waiting(self) -> list[str]:
        """Publish the names found at start that are not published yet (once subscribers
        listen): listed before validation, so that clients see them at once; returns them."""
        names = sorted(self.at_start - self.active.keys() - self.taken)
        if names:
            self._emit("listed", "", names=names)
        return names

    def want(self, name: str) -> None:
        """A request waits for this listed name: examine it before the others."""
        if name in self.at_start:
            self.wanted.add(name)

    def admit(self, now: float) -> None:
        """Examine pending names in sorted order: the wanted ones first, then those in the
        directory at start as their batches are validated, the others while the bucket has a
        token. Many at once (a full directory at start-up, or a bucket with many tokens) are
        validated together first, in parallel and through the hash cache. At most
        PUBLISH_PER_CALL names are examined per call, so that the loop beats between calls."""
        wanted = sorted(self.wanted & self.pending)[:PUBLISH_PER_CALL]
        if wanted:
            self._examine_all(wanted, paced=False, now=now)
        elif self.pending & self.at_start:
            self._admit_at_start(now)
        else:
            self._admit_paced(now)

    def _admit_at_start(self, now: float) -> None:
        """Names of the directory at start whose batch is validated, never waiting for the
        batch that runs (a wanted name is examined meanwhile)."""
        self.validate_ahead()
        running = self.ahead_names if self.ahead is not None else set()
        ready = sorted((self.pending & self.at_start & self.tried_ahead) - running)
        self._examine_all(ready[:PUBLISH_PER_CALL], paced=False, now=now)

    def _admit_paced(self, now: float) -> None:
        tokens = self.bucket.available(now)
        if tokens < 1:
            return
        batch = sorted(self.pending)[:min(tokens, REGISTER_BATCH[1])]
        rest = [n for n in batch if n not in self.prevalidated]
        if len(rest) >= REGISTER_BATCH[0]:
            self.prevalidated |= self._prevalidate(rest)
        self._examine_all(batch[:PUBLISH_PER_CALL], paced=True, now=now)

    def _examine_all(self, names: list[str], paced: bool, now: float) -> None:
        reads = self._read_all(names)
        for name in names:
            self.pending.discard(name)
            self.at_start.discard(name)
            self.tried_ahead.discard(name)
            self.wanted.discard(name)
            if self.examine(name, reads[name]) and paced:
                self.bucket.take(now)

    def _read_all(self, names: list[str]) -> dict[str, Validated | Exception]:
        """Each name's files read (and checked against its validation, or validated) on
        threads, as `_read` does, or the exception that stopped it: reading and hashing
        release the GIL, and publishing stays in order."""
        prevalidated = {n: self.prevalidated.pop(n, None) for n in names}

        def read(name: str) -> Validated | Exception:
            try:
                check_adapter_name(name, self.reserved)
                if name in self.taken:
                    raise AdapterError(name, "the name is served from --adapter; this "
                                             "directory is not published (rename it)")
                return self._read(name, prevalidated[name])
            except Exception as e:  # noqa: BLE001 - examined (and reported) in order
                return e

        futures = {name: self.readers.submit(read, name) for name in names}
        self._wait_beating(futures.values(), VALIDATE_TIMEOUT_S)
        out: dict[str, Validated | Exception] = {}
        for name, future in futures.items():
            if future.done():
                out[name] = future.result()
                continue
            self.too_slow[name] = self._signature(name)
            out[name] = AdapterError(name, f"could not be validated within "
                                           f"{VALIDATE_TIMEOUT_S:g} s; not examined again "
                                           "until its files change")
        return out

    def validate_ahead(self) -> bool:
        """Start validating the next batch of the names in the directory at start, to publish
        as it ends (also while the subscribers connect), unless a batch is still running;
        never waits. False once none is left."""
        if self.ahead is not None:
            if not self.ahead.done():
                return True
            self.prevalidated |= self._valid(self.ahead)
            self.ahead = None
        todo = sorted(self.at_start - self.prevalidated.keys() - self.tried_ahead)
        batch = todo[:REGISTER_BATCH[1]]
        self.tried_ahead.update(batch)
        if batch:
            self.ahead, self.ahead_names = self._submit_batch(batch), set(batch)
        return bool(batch)

    def _submit_batch(self, names: list[str]) -> Future:
        """A batch validated together (load_adapters: threads, or processes for many bytes) on
        a thread of its own."""
        items = {name: self.root / name for name in names if name not in self.taken}
        return self.batches.submit(load_adapters, items, self.model_cfg, self.max_rank,
                                   keep_weights=False, cache=self.cache, pack=self.store.pack)

    @staticmethod
    def _valid(batch: Future) -> dict[str, LoraAdapter]:
        """The batch's valid adapters; the others (or all, if the batch failed) are validated
        one by one when examined."""
        try:
            results = batch.result()
        except Exception:  # noqa: BLE001 - validated one by one instead
            log.exception("validating a batch of adapters failed")
            return {}
        return {name: a for name, a in results.items() if isinstance(a, LoraAdapter)}

    def _prevalidate(self, names: list[str]) -> dict[str, LoraAdapter]:
        """_submit_batch, the loop beating every BEAT_S until it is done."""
        batch = self._submit_batch(names)
        self._wait_beating([batch])
        return self._valid(batch)

    def _wait_beating(self, futures, timeout_s: float = math.inf) -> None:
        """Wait until the futures are done or timeout_s has passed, beating every BEAT_S."""
        waiting = set(futures)
        deadline = time.monotonic() + timeout_s
        while waiting and time.monotonic() < deadline:
            waiting = wait(waiting, timeout=min(BEAT_S, deadline - time.monotonic())).not_done
            self.beat()

    def examine(self, name: str, read: Validated | Exception) -> bool:
        """Publish what one sub-directory became, from its read (_read_all); True if it was
        admitted. Never raises: bad content is a rejected event, and the next name is
        examined."""
        try:
            return self._examine(name, read)
        except Exception as e:  # noqa: BLE001 - one adapter's content never stops the registry
            log.exception("adapter %r could not be examined", name)
            self._reject(name, "invalid_adapter", f"adapter {name!r}: {type(e).__name__}: {e}")
            return False

    def _examine(self, name: str, read: Validated | Exception) -> bool:
        try:
            if isinstance(read, Exception):
                raise read
            validated = read
            rank = validated.adapter.pool_rows
            if rank > self.pool_rows:
                raise AdapterError(name, f"{rank} pool rows exceed the adapter pool "
                                         f"({self.pool_rows} rows)")
        except FilesChanged:
            self.retry.append(name)
            return False
        except InvalidRequestError as e:
            self._reject(name, "bad_name", e.message)
            return False
        except AdapterError as e:
            if e.code == CHANGING:
                self.retry.append(name)
            else:
                self._reject(name, reject_reason(e.reason), str(e))
            return False
        except OSError as e:  # unreadable, or deleted while read (its event follows)
            self._reject(name, "unreadable", f"adapter {name!r}: {e}")
            return False
        return self._publish_version(name, validated)

    def _read(self, name: str, prevalidated: LoraAdapter | None) -> Validated:
        """The files' bytes as validated. With `prevalidated` (validated in a batch, perhaps
        from the hash cache) the bytes read now must hash to its id, so the snapshot holds
        exactly validated content; else (or if they do not) they are validated here."""
        src = self.root / name
        if prevalidated is not None:
            before = file_signature(src, name)
            config_bytes, tensor_bytes = read_adapter_files(name, src)
            if (file_signature(src, name) == before
                    and content_hash(config_bytes, tensor_bytes) == prevalidated.adapter_id):
                return Validated(prevalidated, config_bytes, tensor_bytes)
        return self.store.read(name, src, self.model_cfg, self.max_rank)

    def _signature(self, name: str) -> tuple | None:
        """file_signature of adapter `name`; None while its files vanish."""
        try:
            return file_signature(self.root / name, name)
        except FilesChanged:
            return None

    def _publish_version(self, name: str, validated: Validated) -> bool:
        """Publish a validated version unless it is unchanged; content another name already
        serves shares that name's snapshot (an alias), other content gets a new one."""
        adapter_id = validated.adapter.adapter_id
        current = self.active.get(name)
        if current is not None and current.adapter_id == adapter_id:
            log.debug("adapter %r unchanged", name)
            self.counts[("skipped", "unchanged")] += 1
            return False
        kind = "updated" if current is not None else "added"
        twin = next((p for p in self.active.values()
                     if p.adapter_id == adapter_id and Path(p.path).is_dir()), None)
        if twin is not None:
            path = twin.path
        else:
            try:
                path = self.store.save(validated).path
            except OSError as e:
                self._reject(name, "snapshot_failed", f"adapter {name!r}: no snapshot: {e}")
                return False
        self.active[name] = Published(adapter_id, path)
        self.rejected.discard(name)
        self._emit(kind, name, adapter_id=adapter_id, path=path)
        return True

    def _reject(self, name: str, reason: str, message: str) -> None:
        self.rejected.add(name)
        log.warning("rejected adapter %r (%s): %s", name, reason, message)
        self._emit("rejected", name, reason=reason, message=message)

    def _emit(self, kind: str, name: str, **fields) -> None:
        self.state.seq += 1
        self.counts[(kind, fields.get("reason", ""))] += 1
        self.publish(AdapterEvent(seq=self.state.seq, kind=kind, name=name, at=time.time(),
                                  **fields))
        self._save_state()


def wait_subscribers(pub: zmq.Socket, count: int, timeout_s: float, heart: Heartbeats,
                     work: Callable[[], bool] = lambda: False) -> None:
    """XPUB sees each SUB's subscription: publish nothing before both listen (slow joiner).
    Meanwhile `work` is called, one piece per turn, until it says it has no more."""
    seen = 0
    deadline = time.monotonic() + timeout_s
    working = True
    while seen < count and time.monotonic() < deadline:
        heart.beat()
        if pub.poll(TICK_MS if working else 100) and pub.recv()[:1] == b"\x01":
            seen += 1
        elif working:
            working = work()
    if seen < count:
        log.warning("only %d of %d subscribers after %.0f s; publishing anyway", seen, count,
                    timeout_s)


def drain_subscriptions(pub: zmq.Socket) -> None:
    while pub.poll(0):
        pub.recv()


def make_core(args: ServerArgs, publish) -> RegistryCore:
    config = args.engine_config()
    root = Path(args.adapter_dir).resolve()
    bucket = TokenBucket(args.adapter_rate, args.adapter_burst)
    model_cfg = args.served_model(config, confined=True)
    layouts = pool_layouts(model_cfg, config.lora_pool_dtype(model_cfg), args.tensor_parallel_size)
    return RegistryCore(root, Path(args.state_dir), model_cfg, config.max_rank,
                        config.adapter_rows, bucket, publish,
                        reserved=frozenset({args.model_name}), layouts=layouts,
                        taken=frozenset(args.adapters))


def run(args: ServerArgs, ctx: zmq.Context) -> None:
    endpoint = args.endpoints.registry
    check_local(endpoint)
    pub = ctx.socket(zmq.XPUB)
    pub.setsockopt(zmq.XPUB_VERBOSE, 1)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 1000)
    pub.bind(endpoint)
    encoder = msgspec.msgpack.Encoder()
    core = make_core(args, lambda event: pub.send(encoder.encode(event)))
    heart = Heartbeats(ctx, args, "registry")
    core.beat = lambda: heart.beat(core.state.seq)
    watch = DirWatch(core.root)
    observer = Observer()
    observer.schedule(_Handler(watch), str(core.root), recursive=True)
    observer.start()
    watch.mark(set(core.names_on_disk()) | set(core.active))
    subscribers = args.data_parallel_size + 1  # every replica's scheduler and the api
    wait_subscribers(pub, subscribers, SUBSCRIBE_TIMEOUT_S, heart, core.validate_ahead)
    pub.send(encoder.encode(AdapterEvent(seq=core.state.seq, kind="hello")))
    listed = core.list_waiting()
    # ready once the directory is listed: the server answers no request before its
    # schedulers know which adapters to wait for; the names ride on Ready too, so the api
    # lists them at ready even if the event reaches its subscription later
    send_ready(ctx, args, "registry", {"adapter_dir": str(core.root), "listed": listed})
    log.info("watching %s (%d adapters published so far)", core.root, len(core.active))
    wants = Inbox(ctx, args.endpoints.registry_wants, AdapterWanted)
    try:
        serve_forever(heart, functools.partial(turn, core, watch, pub, wants, args.adapter_quiet_s))
    finally:
        observer.stop()


def turn(core: RegistryCore, watch: DirWatch, pub: zmq.Socket, wants: Inbox,
         quiet_s: float) -> int:
    """The wanted names that came within TICK_MS, new subscribers, then the names whose files
    changed; returns the last event's seq."""
    for wanted in wants.recv_within(TICK_MS):
        core.want(wanted.name)
    drain_subscriptions(pub)
    try:
        tick(core, watch, quiet_s)
    except Exception:  # noqa: BLE001 - the names being examined are dropped, not retried
        log.exception("registry: examining changed adapters failed; watching on")
    return core.state.seq


def tick(core: RegistryCore, watch: DirWatch, quiet_s: float) -> None:
    now = time.monotonic()
    if core.retry:
        watch.mark(core.retry)
        core.retry.clear()
    core.on_changed(watch.take_ready(now, quiet_s))
    core.admit(now)


if __name__ == "__main__":
    child_main("registry", run)
