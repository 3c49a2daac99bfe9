"""ZeroMQ entry for low-latency Python callers (radixlora.server.client): a ROUTER socket in the
api process that takes GenerateReq / AbortReq and streams OutputBatch / ReqError back, through
the same validation and request tracking as HTTP."""

from __future__ import annotations

import asyncio
import functools
import logging

import msgspec
import zmq

from radixlora.errors import InvalidRequestError
from radixlora.server.bridge import DuplicateRequestId, ProcessBridge, ReqFailed, ServiceUnavailable
from radixlora.server.ipc import check_local
from radixlora.server.messages import (
    MAX_MESSAGE_BYTES,
    AbortReq,
    Codec,
    GenerateReq,
    OutputBatch,
    ReqError,
)
from radixlora.server.protocol import adapter_label, stop_list

log = logging.getLogger(__name__)


class ClientGateway:
    def __init__(self, runtime: ProcessBridge, endpoint: str, vocab_size: int):
        check_local(endpoint)
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
            if len(frames) != 2:
                log.warning("dropped a client message of %d frames (expected 2)", len(frames))
                continue
            identity, raw = frames
            msg = self.codec.decode(raw, functools.partial(self._send, identity))
            if isinstance(msg, GenerateReq):
                task = asyncio.create_task(self._generate(identity, msg))
                self.tasks.add(task)
                task.add_done_callback(self.tasks.discard)
            elif isinstance(msg, AbortReq):
                self.runtime.abort(_internal_rid(identity, msg.rid))

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
