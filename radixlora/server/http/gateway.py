"""ZeroMQ entry for low-latency Python callers (radixlora.server.client): a ROUTER socket in the
api process that takes GenerateReq / AbortReq and streams OutputBatch / ReqError back, through
the same validation and request tracking as HTTP."""

from __future__ import annotations

import asyncio
import functools
import hmac
import logging

import msgspec
import zmq

from radixlora.errors import InvalidRequestError
from radixlora.protocol.common import adapter_label, stop_list
from radixlora.server.http.bridge import (
    DuplicateRequestId,
    ProcessBridge,
    ReqFailed,
    ServiceUnavailable,
)
from radixlora.server.ipc import check_local
from radixlora.server.messages import (
    MAX_MESSAGE_BYTES,
    AbortReq,
    Codec,
    GenerateReq,
    OutputBatch,
    ReqError,
)

log = logging.getLogger(__name__)


class ClientGateway:
    def __init__(self, runtime: ProcessBridge, endpoint: str, vocab_size: int,
                 key: str | None = None):
        """key: clients send it as a first frame before each message (RuntimeClient's api_key);
        a GenerateReq without it, or with another, is answered 401 and nothing else is done."""
        check_local(endpoint)
        self.key = key.encode() if key else None
        self.runtime = runtime
        self.vocab_size = vocab_size
        self.sock = runtime.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        self.sock.bind(endpoint)
        self.codec = Codec(GenerateReq | AbortReq)
        self.encoder = msgspec.msgpack.Encoder()
        self.tasks: set[asyncio.Task] = set()

    async def serve(self) -> None:
        while True:
            frames = await self.sock.recv_multipart()
            if len(frames) not in (2, 3):
                log.warning("dropped a client message of %d frames (expected 2 or 3)",
                            len(frames))
                continue
            identity, *key, raw = frames
            if not self._authorized(key):
                self._refuse(identity, raw)
                continue
            msg = self.codec.decode(raw, functools.partial(self._send, identity))
            if isinstance(msg, GenerateReq):
                task = asyncio.create_task(self._generate(identity, msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(msg, AbortReq):
                self.runtime.abort(_internal_rid(identity, msg.rid))

    def _refuse(self, identity: bytes, raw: bytes) -> None:
        """A message without the key: a 401 to a request it names, no other answer (nothing
        about the message's validity reaches a client without the key)."""
        msg = self.codec.decode(raw)
        if isinstance(msg, GenerateReq):
            self._send(identity, ReqError(
                rid=msg.rid, status=401, code="invalid_api_key",
                message="the ZeroMQ client endpoint needs the server's key "
                        "(RuntimeClient(..., api_key=KEY))"))

    def _authorized(self, key: list[bytes]) -> bool:
        if self.key is None:
            return True
        return len(key) == 1 and hmac.compare_digest(key[0], self.key)

    async def _generate(self, identity: bytes, req: GenerateReq) -> None:
        try:
            await self._run(identity, req)
        except (ReqFailed, InvalidRequestError, ServiceUnavailable, DuplicateRequestId) as e:
            self._send(identity, _as_error(req.rid, e))
        except Exception:  # noqa: BLE001 - one request never stops the gateway
            log.exception("ZeroMQ request %s failed", req.rid)
            self._send(identity, ReqError(rid=req.rid, message="internal error",
                                          code="internal_error", status=500))

    async def _run(self, identity: bytes, req: GenerateReq) -> None:
        req.params.validate(self.vocab_size)
        stop_list(req.stop)
        internal = msgspec.structs.replace(req, rid=_internal_rid(identity, req.rid))
        gens = self.runtime.submit([internal], adapter_label(req.adapters))
        async for _, out in self.runtime.events(gens):
            self._send(identity, OutputBatch(outputs=[msgspec.structs.replace(out, rid=req.rid)]))

    def _send(self, identity: bytes, msg) -> None:
        self.sock.send_multipart([identity, self.encoder.encode(msg)])


def _internal_rid(identity: bytes, rid: str) -> str:
    return f"zmq-{identity.hex()}-{rid}"


def _as_error(rid: str, e: Exception) -> ReqError:
    if isinstance(e, ReqFailed):
        return msgspec.structs.replace(e.error, rid=rid)
    if isinstance(e, InvalidRequestError):
        return ReqError(rid=rid, message=e.message, code=e.code, param=e.param)
    if isinstance(e, DuplicateRequestId):
        return ReqError(rid=rid, message=str(e), code="duplicate_request_id", param="rid",
                        status=409)
    return ReqError(rid=rid, message=str(e), code="unavailable", status=503)
