"""Registration of many adapters at once: validation in parallel, content hashes cached.

`load_adapters` validates a set of adapter directories and returns, in input order, each
adapter or its AdapterError. Validation is mostly many small torch operations that hold the
GIL, so threads only read and hash the files (both release it) while the caller's thread
validates in order; without weights (the scheduler and the registry keep only ids and ranks),
at least PROCESS_MIN_BYTES of cold adapters are validated whole in spawned processes (with at
least PROCESS_MIN_WORKERS workers).

The hash cache (`HashCache`, a JSON file in `cache_dir()`) maps the stamp of an adapter's two
files (real path, inode, size, mtime_ns, ctime_ns of each) to the content hash of a version
that passed every check, the value checks (finite weights) included. It is written only after
such a full validation whose stamps were the same before and after the read. On a hit the
checks that depend on the model and the server (names, layers, ranks, dtypes, shapes) run
again from the config and the safetensors header; the values are not read and not hashed, and
the adapter id is the cached hash. Guarantee: a stale entry (a file rewritten with the same
stamp) can only mislabel content, never serve it: only the scheduler, the registry and their
start-up use the cache and they keep no weights; the worker never uses it: it re-reads,
re-validates and re-hashes every adapter it loads and refuses one whose hash is not the id
(adapter_load_failed), as for any file changed after validation, or it reads the adapter's
packed file, which only a full validation of bytes hashing to that id writes (`PackTarget`).
The Engine, which serves the weights it reads itself, does not use the cache."""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import logging
import multiprocessing
import os
import stat
import tempfile
from collections.abc import Iterator, Mapping
from concurrent.futures import Future, ProcessPoolExecutor, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec
import torch

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError
from radixlora.lora.adapter import (
    adapter_from_bytes,
    content_hash,
    load_adapter,
    read_adapter_files,
)
from radixlora.lora.header import LoraAdapter, adapter_from_header, check_header
from radixlora.lora.host_cache import packed_name, write_packed

if TYPE_CHECKING:
    from radixlora.lora.layout import PoolLayout

log = logging.getLogger(__name__)

ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")
CACHE_FILE = "adapter_hashes.json"
CACHE_VERSION = 1
MAX_CACHE_ENTRIES = 20_000  # the most recently validated are kept
MAX_WORKERS = 32
# fewer bytes of cold adapters (about 6 s of serial validation) do not repay starting processes
# (about 2 s: each imports torch)
PROCESS_MIN_BYTES = 1 << 30
PROCESS_MIN_WORKERS = 4  # on fewer cores the imports cost more than the processes save

Outcome = LoraAdapter | AdapterError


@dataclass(frozen=True)
class PackTarget:
    """Where validation also packs each adapter it reads the values of, for the workers' pool
    layouts: one packed file per layout in `root`/<adapter id>/ (radixlora.lora.host_cache),
    taken into the adapter's snapshot when it is saved (AdapterStore.save)."""

    root: Path
    layouts: tuple[PoolLayout, ...]

    def directory(self, adapter_id: str) -> Path:
        return self.root / adapter_id

    def done(self, adapter_id: str) -> bool:
        return all((self.directory(adapter_id) / packed_name(layout.key)).is_file()
                   for layout in self.layouts)

    def write(self, adapter: LoraAdapter, directory: Path | None = None) -> None:
        """Pack `adapter` (with weights) for every layout into `directory` (default its own
        directory under root). A failure is logged: the workers then pack it themselves."""
        directory = directory or self.directory(adapter.adapter_id)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            for layout in self.layouts:
                if not (directory / packed_name(layout.key)).is_file():
                    write_packed(directory, layout.key, layout.pack(adapter))
        except OSError as e:
            log.warning("adapter %r: not packed ahead for the workers: %s", adapter.name, e)


def default_workers() -> int:
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0))))


def cache_dir() -> Path:
    """$RADIXLORA_CACHE_DIR, else $XDG_CACHE_HOME/radixlora, else ~/.cache/radixlora."""
    if explicit := os.environ.get("RADIXLORA_CACHE_DIR"):
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "radixlora"


def adapter_stamp(path: str | Path) -> str | None:
    """The cache key of an adapter directory's files as they are now; None if one is missing
    or not a regular file."""
    parts = []
    for file in ADAPTER_FILES:
        real = os.path.realpath(Path(path) / file)
        try:
            st = os.stat(real)
        except OSError:
            return None
        if not stat.S_ISREG(st.st_mode):
            return None
        parts.append(f"{real}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}")
    return "\n".join(parts)


class CacheFile(msgspec.Struct):
    version: int
    entries: dict[str, str]  # adapter stamp -> content hash of a fully validated version


class HashCache:
    """Adapter stamps -> content hashes of fully validated versions, persisted as JSON. An
    unreadable or corrupt file is ignored (logged once) and replaced at the next save."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path is not None else cache_dir() / CACHE_FILE
        self.warned = False
        self.entries = self._read()
        self.added: dict[str, str] = {}
        self.hits = 0

    def get(self, stamp: str | None) -> str | None:
        digest = self.entries.get(stamp) if stamp is not None else None
        self.hits += digest is not None
        return digest

    def put(self, stamp: str, digest: str) -> None:
        self.entries[stamp] = digest
        self.added[stamp] = digest

    def save(self) -> None:
        """Merge this process's new entries into the file (another process may have saved
        since it was read) and replace it atomically; failures are logged, never raised."""
        if not self.added:
            return
        on_disk = self._read()
        entries = [(k, v) for k, v in on_disk.items() if k not in self.added]
        entries = dict((entries + list(self.added.items()))[-MAX_CACHE_ENTRIES:])
        try:
            self.path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(prefix=f".{self.path.name}.", dir=self.path.parent)
            with open(fd, "wb") as f:
                f.write(msgspec.json.encode(CacheFile(CACHE_VERSION, entries)))
            os.replace(tmp, self.path)
        except OSError as e:
            self._warn(f"adapter hash cache {self.path} not saved: {e}")
            return
        self.added.clear()

    def _read(self) -> dict[str, str]:
        try:
            cached = msgspec.json.decode(self.path.read_bytes(), type=CacheFile)
        except FileNotFoundError:
            return {}
        except (OSError, msgspec.DecodeError, msgspec.ValidationError) as e:
            self._warn(f"adapter hash cache {self.path} ignored: {e}")
            return {}
        return cached.entries if cached.version == CACHE_VERSION else {}

    def _warn(self, message: str) -> None:
        if not self.warned:
            log.warning(message)
            self.warned = True


def load_adapters(items: Mapping[str, str | Path], model: ModelConfig, max_rank: int, *,
                  workers: int | None = None, cache: HashCache | None = None,
                  keep_weights: bool = True, pack: PackTarget | None = None
                  ) -> dict[str, Outcome]:
    """Validate every adapter of `items` (name -> directory), in parallel; name -> the adapter
    or its AdapterError, in input order. With keep_weights=False the adapters come back
    without weights, and only then is `cache` used (see the module docstring). With `pack`,
    every valid adapter is also packed there: a cache hit not packed yet is validated again."""
    if cache is not None and keep_weights:
        raise ValueError("the hash cache is for registration without weights")
    workers = workers or default_workers()
    outcomes: dict[str, Outcome] = {}
    cold: dict[str, str | Path] = {}
    for name, path in items.items():
        digest = cache.get(adapter_stamp(path)) if cache is not None else None
        if digest is None or pack is not None and not pack.done(digest):
            cold[name] = path
        else:
            outcomes[name] = _from_header(name, path, model, max_rank, digest)
    for name in list(cold):  # a wrong adapter is refused for the cost of its header
        try:
            check_header(name, cold[name], model, max_rank)
        except AdapterError as e:
            outcomes[name] = e
            del cold[name]
    in_processes = (not keep_weights and workers >= PROCESS_MIN_WORKERS
                    and _tensor_bytes(cold) >= PROCESS_MIN_BYTES)
    validated = (_in_processes if in_processes else _on_threads)(cold, model, max_rank, workers,
                                                                  keep_weights, pack)
    for name, (outcome, stamp) in zip(cold, validated):
        outcomes[name] = outcome
        if cache is not None and stamp is not None and isinstance(outcome, LoraAdapter):
            cache.put(stamp, outcome.content_hash)
    if cache is not None:
        cache.save()
    return {name: outcomes[name] for name in items}


def _tensor_bytes(items: Mapping[str, str | Path]) -> int:
    total = 0
    for path in items.values():
        with contextlib.suppress(OSError):
            total += os.stat(Path(path) / ADAPTER_FILES[1]).st_size
    return total


def iter_adapters(items: Mapping[str, str | Path], model: ModelConfig, max_rank: int,
                  workers: int | None = None) -> Iterator[tuple[str, Outcome]]:
    """(name, adapter with weights or its AdapterError) in input order, read ahead on threads;
    the consumer may stop early."""
    validated = _on_threads(items, model, max_rank, workers or default_workers(), True, None)
    for name, (outcome, _) in zip(items, validated):
        yield name, outcome


def _on_threads(items: Mapping[str, str | Path], model: ModelConfig, max_rank: int,
                workers: int, keep_weights: bool,
                pack: PackTarget | None) -> Iterator[tuple[Outcome, str | None]]:
    """Files read and hashed on threads (both release the GIL), at most 2 x workers ahead;
    validation, which mostly holds the GIL, in the caller's thread, in order."""
    pool = ThreadPoolExecutor(workers)
    pending: collections.deque[tuple[str, Future]] = collections.deque()
    try:
        for name, path in items.items():
            pending.append((name, pool.submit(_read, name, path)))
            if len(pending) >= 2 * workers:
                yield _validate_read(*pending.popleft(), model, max_rank, keep_weights, pack)
        while pending:
            yield _validate_read(*pending.popleft(), model, max_rank, keep_weights, pack)
    finally:
        pool.shutdown(cancel_futures=True)


@dataclass
class _Read:
    """An adapter's files as read; validation empties tensor_bytes once the weights are built,
    so the bytes are not held beside the packing."""

    path: str
    config_bytes: bytes
    tensor_bytes: bytes
    digest: str
    stamp: str | None  # None if the files changed while they were read


def _read(name: str, path: str | Path) -> _Read | AdapterError:
    before = adapter_stamp(path)
    try:
        config_bytes, tensor_bytes = read_adapter_files(name, Path(path))
    except AdapterError as e:
        return e
    stamp = before if before is not None and adapter_stamp(path) == before else None
    return _Read(str(path), config_bytes, tensor_bytes, content_hash(config_bytes, tensor_bytes),
                 stamp)


def _validate_read(name: str, future: Future, model: ModelConfig, max_rank: int,
                   keep_weights: bool, pack: PackTarget | None) -> tuple[Outcome, str | None]:
    read = future.result()
    if isinstance(read, AdapterError):
        return read, None
    try:
        adapter = adapter_from_bytes(name, read.path, read.config_bytes, read.tensor_bytes, model,
                                     max_rank, digest=read.digest)
    except AdapterError as e:
        return e, None
    finally:
        read.tensor_bytes = b""
    if pack is not None:
        pack.write(adapter)
    if not keep_weights:
        adapter = dataclasses.replace(adapter, weights={}, magnitudes={})
    return adapter, read.stamp


def _in_processes(items: Mapping[str, str | Path], model: ModelConfig, max_rank: int,
                  workers: int, keep_weights: bool,
                  pack: PackTarget | None) -> Iterator[tuple[Outcome, str | None]]:
    """Whole validations in spawned processes of one torch thread each, for adapters without
    weights (small results). What a process found in an adapter's files comes back as msgpack
    bytes decoded into a typed JobOutcome: the parent unpickles nothing a file could shape
    (the pool pickles only the jobs it sends and those bytes)."""
    jobs = [(name, str(path), model, max_rank, pack) for name, path in items.items()]
    context = multiprocessing.get_context("spawn")
    decoder = msgspec.msgpack.Decoder(JobOutcome)
    with ProcessPoolExecutor(workers, mp_context=context, initializer=one_torch_thread) as pool:
        for raw in pool.map(validate_job, jobs, chunksize=4):
            yield decoder.decode(raw).outcome()


class JobOutcome(msgspec.Struct):
    """A spawned validation's result: an adapter without weights, or its error."""

    name: str
    path: str = ""
    content_hash: str = ""
    rank: int = 0
    group_ranks: dict[str, int] = {}
    trained_on: str | None = None
    base_mismatch: str = ""
    stamp: str | None = None
    error: tuple[str, str] | None = None  # (reason, code)
    dora_groups: tuple[str, ...] = ()

    def outcome(self) -> tuple[Outcome, str | None]:
        if self.error is not None:
            return AdapterError(self.name, *self.error), None
        return LoraAdapter(self.name, self.path, self.content_hash, self.rank,
                           self.group_ranks, {}, self.trained_on, self.base_mismatch,
                           self.dora_groups), self.stamp


def one_torch_thread() -> None:
    torch.set_num_threads(1)


def validate_job(job: tuple[str, str, ModelConfig, int, PackTarget | None]) -> bytes:
    name, path, model, max_rank, pack = job
    before = adapter_stamp(path)
    try:
        adapter = load_adapter(name, path, model, max_rank)
    except AdapterError as e:
        return msgspec.msgpack.encode(JobOutcome(e.name, error=(e.reason, e.code)))
    if pack is not None:
        pack.write(adapter)
    stamp = before if before is not None and adapter_stamp(path) == before else None
    return msgspec.msgpack.encode(JobOutcome(
        name, adapter.path, adapter.content_hash, adapter.rank, adapter.group_ranks,
        adapter.trained_on, adapter.base_mismatch, stamp, dora_groups=adapter.dora_groups))


def _from_header(name: str, path: str | Path, model: ModelConfig, max_rank: int,
                 digest: str) -> Outcome:
    try:
        return adapter_from_header(name, path, model, max_rank, digest)
    except AdapterError as e:
        return e
