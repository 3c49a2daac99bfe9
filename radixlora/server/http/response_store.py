"""Stored responses of /v1/responses, in the api process's memory: each one's Response object and
the conversation it ended (input items, then output items), which previous_response_id
continues. Bounded by age (--responses-store-ttl) and by bytes (--responses-store-bytes, the
least recently used go first); a response belongs to the key that created it. Nothing is
written to disk, and a restart forgets every response. Thread-safe: a large response is built
and kept on a thread (radixlora.server.http.common.json_answer)."""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

import orjson


@dataclass
class Stored:
    owner: str
    response: dict
    conversation: list[dict]  # input items then output items: what a continuation starts from
    nbytes: int
    created: float


class ResponseStore:
    def __init__(self, max_bytes: int, ttl_s: float, clock=time.monotonic):
        self.max_bytes = max_bytes
        self.ttl_s = ttl_s
        self.clock = clock
        self.entries: OrderedDict[str, Stored] = OrderedDict()  # least recently used first
        self.born: OrderedDict[str, float] = OrderedDict()  # oldest first
        self.nbytes = 0
        self.lock = threading.Lock()

    def put(self, resp_id: str, owner: str, response: dict, conversation: list[dict]) -> None:
        """Keep a response; one larger than the whole budget is not kept."""
        size = len(orjson.dumps(response)) + len(orjson.dumps(conversation))
        if size > self.max_bytes:
            return
        with self.lock:
            self._put(resp_id, Stored(owner, response, conversation, size, self.clock()))

    def _put(self, resp_id: str, entry: Stored) -> None:
        if resp_id in self.entries:
            self._drop(resp_id)
        self.entries[resp_id] = entry
        self.born[resp_id] = entry.created
        self.nbytes += entry.nbytes
        self._expire()
        while self.nbytes > self.max_bytes:
            self._drop(next(iter(self.entries)))

    def get(self, resp_id: str, owner: str) -> Stored | None:
        """The stored response, if it exists, has not expired and belongs to `owner`."""
        with self.lock:
            self._expire()
            entry = self.entries.get(resp_id)
            if entry is None or entry.owner != owner:
                return None
            self.entries.move_to_end(resp_id)
            return entry

    def delete(self, resp_id: str, owner: str) -> bool:
        with self.lock:
            entry = self.entries.get(resp_id)
            if entry is None or entry.owner != owner:
                return False
            self._drop(resp_id)
            return True

    def _drop(self, resp_id: str) -> None:
        self.nbytes -= self.entries.pop(resp_id).nbytes
        del self.born[resp_id]

    def _expire(self) -> None:
        limit = self.clock() - self.ttl_s
        while self.born and next(iter(self.born.values())) < limit:
            self._drop(next(iter(self.born)))
