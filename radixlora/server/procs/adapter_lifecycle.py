"""Adapter changes while the scheduler process serves: registry events and admin calls.

Invariants: a name resolves to exactly one version (content hash) at a time; a version no name
points to is retired, and stays resident for the requests already admitted on it until none
is left (nor a step in flight that loads it), then its radix-tree namespaces are dropped, its
pool rows freed (as the offline Engine does) and its snapshots deleted. Several names may point
to one version (aliases: same content); it is retired when the last of them goes. No exception
from one adapter's event or admin call leaves its handler."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence

from radixlora.config import ModelConfig
from radixlora.errors import AdapterError, AdapterNotFoundError, InvalidRequestError
from radixlora.lora.header import CHANGING, LoraAdapter, adapter_from_header, check_header
from radixlora.sched.adapter_registry import AdapterRegistry
from radixlora.sched.request import uses_adapter
from radixlora.sched.scheduler import Scheduler
from radixlora.server.messages import AdapterEvent, AdminReply, AdminReq
from radixlora.server.procs.adapter_store import AdapterStore, FilesChanged

log = logging.getLogger(__name__)

PINNED_SHARE = 0.5  # pinned adapters may hold at most this share of the pool's rows


class AdapterLifecycle:
    def __init__(self, registry: AdapterRegistry, scheduler: Scheduler,
                 store: AdapterStore | None, model_cfg: ModelConfig, max_rank: int,
                 in_use: Callable[[str], bool], allowed_roots: Sequence[str] = (),
                 start_names: frozenset[str] = frozenset()):
        self.registry = registry
        self.start_names = start_names  # --adapter names: an admin load replaces them on request
        self.allowed_roots = tuple(allowed_roots)  # every file an admin load reads is inside
        self.scheduler = scheduler
        self.store = store
        self.model_cfg = model_cfg
        self.max_rank = max_rank
        self.in_use = in_use  # adapter id -> does an open request (or a step in flight) use it
        self.retired: set[str] = set()
        self.snapshots: dict[str, set[str]] = {}  # adapter id -> its snapshots registered
        self.pinned_names: set[str] = set()
        self.dir_names: set[str] = set()  # names the registry's events registered
        # --adapter-dir names whose latest version was rejected, and why
        self.rejected: dict[str, str] = {}
        self.listed: set[str] = set()  # --adapter-dir names listed and not validated yet
        self.last_seq = 0

    # ---- registry events ---------------------------------------------------------------------

    def on_event(self, event: AdapterEvent) -> None:
        if event.seq != self.last_seq + 1 and event.kind != "hello" and self.last_seq:
            log.warning("adapter event %d after %d: events were missed", event.seq, self.last_seq)
        self.last_seq = max(self.last_seq, event.seq)
        if event.kind == "listed":
            self.listed.update(n for n in event.names if n not in self.registry.by_name)
        self.listed.discard(event.name)
        if event.kind == "rejected":
            self.rejected[event.name] = event.message or event.reason
        elif event.kind in ("added", "updated", "removed"):
            self.rejected.pop(event.name, None)
        try:
            if event.kind in ("added", "updated"):
                self._register_from_dir(event)
            elif event.kind == "removed" and event.name in self.dir_names:
                self.dir_names.discard(event.name)
                self.unregister(event.name)
        except (AdapterError, InvalidRequestError) as e:
            log.error("adapter event %d (%s %r) not applied: %s", event.seq, event.kind,
                      event.name, e)
        except Exception:  # noqa: BLE001 - one adapter's content never stops the scheduler
            log.exception("adapter event %d (%s %r) not applied", event.seq, event.kind,
                          event.name)

    def _register_from_dir(self, event: AdapterEvent) -> None:
        """An --adapter-dir version, unless the name is served from --adapter or an admin
        load: those are never replaced by a directory of the same name."""
        if event.name in self.registry.by_name and event.name not in self.dir_names:
            raise AdapterError(event.name, "the name is served from --adapter or an admin "
                                           "load; the --adapter-dir version is not used")
        self.register(event.name, event.path, event.adapter_id)
        self.dir_names.add(event.name)

    def register(self, name: str, path: str, adapter_id: str = "") -> LoraAdapter:
        """Register a version (a re-used name is a new identity with its own cache namespace);
        the version it replaces is retired: requests already admitted finish on it. A snapshot
        of the store published with its id (the registry validated it whole, values included)
        is checked from its config and header only, as a hash-cache hit is: the worker
        re-hashes whatever it reads and refuses a mismatch."""
        if adapter_id and self.store is not None and self.store.owns(path):
            trusted = adapter_from_header(name, path, self.model_cfg, self.max_rank, adapter_id)
            adapter, replaced = self.registry.add(trusted)
        else:
            adapter, replaced = self.registry.load(name, path)
        if adapter_id and adapter.adapter_id != adapter_id:
            self.registry.remove(name)
            raise AdapterError(name, f"{path} does not hash to the published {adapter_id[:12]}")
        if self.store is not None and self.store.owns(path):
            self.snapshots.setdefault(adapter.adapter_id, set()).add(str(path))
        if name in self.pinned_names:
            self.scheduler.residency.pin(adapter.adapter_id)
        self.retired.discard(adapter.adapter_id)
        if replaced is not None:
            self._retire(replaced)
        log.info("adapter %r is version %s", name, adapter.adapter_id[:12])
        return adapter

    def unregister(self, name: str) -> bool:
        """Unname an adapter; True if requests still use the version (they finish on it)."""
        adapter = self.registry.remove(name)
        self.pinned_names.discard(name)
        self._retire(adapter)
        return adapter.adapter_id in self.retired

    def _retire(self, adapter: LoraAdapter) -> None:
        if not self.registry.is_named(adapter.adapter_id):
            self.retire_id(adapter.adapter_id)

    def retire_id(self, adapter_id: str) -> None:
        """A version no name points to any more: forgotten once no request uses it."""
        self.scheduler.residency.unpin(adapter_id)
        self.retired.add(adapter_id)
        self.sweep()

    def sweep(self) -> None:
        """Forget the retired versions no open request uses any more."""
        tree = self.scheduler.tree
        for adapter_id in [a for a in self.retired if not self.in_use(a)]:
            if tree is not None:
                tree.drop_namespaces(lambda ns, a=adapter_id: uses_adapter(ns, a),
                                     self.scheduler.kv.free)
            if self.scheduler.residency.evict(adapter_id):
                self.retired.discard(adapter_id)
                for path in self.snapshots.pop(adapter_id, ()):
                    self.store.delete(path)

    # ---- admin -------------------------------------------------------------------------------

    def admin(self, req: AdminReq, read: Callable[[], LoraAdapter | None] | None = None
              ) -> AdminReply:
        """Apply an admin call. read: a load's read_load() outcome, produced off the loop
        (returns it or raises what it raised); None: the load reads here."""
        try:
            info = self._admin(req, read)
        except AdapterNotFoundError as e:
            return AdminReply(qid=req.qid, status=404, message=str(e), code=e.code)
        except NameTaken as e:
            return AdminReply(qid=req.qid, status=409, message=str(e), code="name_taken")
        except FilesChanged as e:  # about the files: the request's lora_path
            return AdminReply(qid=req.qid, status=409, message=str(e), code="adapter_changing",
                              param="lora_path")
        except AdapterError as e:  # a load's: about its files
            status = {"path_not_allowed": 403, CHANGING: 409}.get(e.code, 400)
            return AdminReply(qid=req.qid, status=status, message=str(e), code=e.code,
                              param="lora_path" if req.op == "load" else "lora_name")
        except InvalidRequestError as e:
            return AdminReply(qid=req.qid, status=400, message=e.message, code=e.code)
        except Exception as e:  # noqa: BLE001 - one adapter's content never stops the scheduler
            log.exception("admin %s %r failed", req.op, req.name)
            return AdminReply(qid=req.qid, status=500, message=f"adapter {req.name!r}: "
                              f"{type(e).__name__}: {e}", code="internal_error")
        return AdminReply(qid=req.qid, info={"lora_name": req.name, **info})

    def _admin(self, req: AdminReq, read) -> dict:
        if req.op == "load":
            if req.name in self.start_names and not req.replace:
                raise NameTaken(req.name)
            adapter = self._load(req.name, req.path, read)
            self.dir_names.discard(req.name)  # the operator's version: the directory's no more
            return {"adapter_id": adapter.adapter_id}
        if req.op == "unload":
            self.dir_names.discard(req.name)
            return {"in_flight": self.unregister(req.name)}
        if req.op in ("pin", "unpin"):
            self._pin(req.name, req.op == "pin")
            return {"pinned": req.op == "pin"}
        raise InvalidRequestError(f"unknown admin operation {req.op!r}", param="op")

    def _load(self, name: str, path: str, read=None) -> LoraAdapter:
        snapshot = read() if read is not None else self.read_load(name, path)
        if snapshot is not None:
            return self.register(name, snapshot.path, snapshot.adapter_id)
        return self.register(name, path)

    def read_load(self, name: str, path: str) -> LoraAdapter | None:
        """What an admin load reads, safe on a thread (the files and the store only): the name
        is checked first, its safetensors header next (names, shapes, dtypes: a wrong adapter
        is refused before its tensors are read), and both files must resolve inside the
        allowed roots (the api confined only the directory). The validated snapshot, or None
        without a store (register reads the adapter)."""
        self.registry.check_name(name)
        if self.store is not None:
            return self.store.snapshot(name, path, self.model_cfg, self.max_rank,
                                       roots=self.allowed_roots)
        check_header(name, path, self.model_cfg, self.max_rank, self.allowed_roots)
        return None

    def _pin(self, name: str, pin: bool) -> None:
        adapter = self.registry.by_name.get(name)
        if adapter is None:
            raise AdapterNotFoundError(name)
        residency = self.scheduler.residency
        if not pin:
            self.pinned_names.discard(name)
            residency.unpin(adapter.adapter_id)
            return
        pinned = [self.registry.by_name[n] for n in self.pinned_names - {name}]
        pinned_rows = sum(a.pool_rows for a in pinned)
        if pinned_rows + adapter.pool_rows > PINNED_SHARE * residency.rows.num_rows:
            raise InvalidRequestError(
                f"pinning {name!r} would pin more than {PINNED_SHARE:.0%} of the adapter pool's "
                f"{residency.rows.num_rows} rows", param="lora_name", code="pin_limit")
        low_rows = sum(a.pool_rows for a in pinned if residency.low_only(a))
        if residency.low_only(adapter) and (low_rows + adapter.pool_rows
                                            > PINNED_SHARE * residency.rows.low):
            raise InvalidRequestError(
                f"pinning {name!r} would pin more than {PINNED_SHARE:.0%} of the "
                f"{residency.rows.low} rows the adapter pool has on modules outside its target "
                "modules (--lora-target-modules)", param="lora_name", code="pin_limit")
        self.pinned_names.add(name)
        residency.pin(adapter.adapter_id)


class NameTaken(Exception):
    def __init__(self, name: str):
        super().__init__(f"adapter {name!r} was given at start (--adapter); a load replaces it "
                         'only with "replace": true')
