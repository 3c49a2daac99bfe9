"""Adapter files read, validated and packed in spawned processes, for a worker that launches
steps: reading an adapter in the worker itself holds the GIL for long stretches (parsing the
safetensors bytes holds it for the whole parse, about 150 ms for a 335 MB adapter), and the
thread that launches steps then waits that long between two launches. A packing process
validates the whole adapter and writes its packed file for the worker's pool layout
(radixlora.lora.registration's job, `PackTarget`) into a directory of its own under `root`;
the worker reads that one file into (pinned) host memory, which releases the GIL, and
deletes it.

Guarantee, as for the packed files of snapshots: the file the worker reads was written by a
full validation of bytes whose content hash is the adapter id the scheduler validated; an
adapter whose files changed since is refused (adapter_load_failed)."""

from __future__ import annotations

import multiprocessing
import secrets
import shutil
import threading
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import msgspec

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError
from radixlora.lora.host_cache import PackedAdapter, read_packed
from radixlora.lora.layout import PoolLayout
from radixlora.lora.registration import JobOutcome, PackTarget, one_torch_thread, validate_job
from radixlora.step_plan import AdapterLoad

# an adapter whose files no longer hash to the id the scheduler validated
FILES_CHANGED = "its files changed on disk after validation (content hash differs)"


class ProcessPacker:
    """At most `processes` adapters packed at once, each in a spawned process (started on the
    first read, kept for later ones)."""

    def __init__(self, root: Path, model: ModelConfig, max_rank: int, processes: int):
        self.root = root
        self.model = model
        self.max_rank = max_rank
        self.processes = processes
        self._pool: ProcessPoolExecutor | None = None
        self._lock = threading.Lock()
        self._decoder = msgspec.msgpack.Decoder(JobOutcome)

    def read(self, load: AdapterLoad, layout: PoolLayout, pin: bool) -> PackedAdapter:
        """The adapter of `load` packed for `layout`, or its AdapterError."""
        target = PackTarget(self.root / secrets.token_hex(8), (layout,))
        try:
            outcome = self._run((load.name, load.path, self.model, self.max_rank, target))
            if outcome.error is not None:
                raise AdapterError(load.name, *outcome.error)
            if outcome.content_hash != load.adapter_id:
                raise AdapterError(load.name, FILES_CHANGED)
            packed = read_packed(target.directory(load.adapter_id), layout.key,
                                 load.adapter_id, pin)
        finally:
            shutil.rmtree(target.root, ignore_errors=True)
        if packed is None or not layout.holds(packed):
            raise AdapterError(load.name, "its packed file could not be written or read back")
        return packed

    def _run(self, job) -> JobOutcome:
        pool = self._executor()
        try:
            return self._decoder.decode(pool.submit(validate_job, job).result())
        except BrokenProcessPool:  # a packing process died (e.g. out of memory): start afresh
            with self._lock:
                if self._pool is pool:
                    self._pool = None
            pool.shutdown(wait=False, cancel_futures=True)
            raise AdapterError(job[0], "the process packing it died") from None

    def _executor(self) -> ProcessPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ProcessPoolExecutor(
                    self.processes, mp_context=multiprocessing.get_context("spawn"),
                    initializer=one_torch_thread)
            return self._pool

    def close(self) -> None:
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=False, cancel_futures=True)
        shutil.rmtree(self.root, ignore_errors=True)
