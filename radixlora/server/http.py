"""HTTP helpers: orjson responses, OpenAI-shaped errors, JSON bodies validated with msgspec, an
SSE response that watches for the client leaving, and disconnect-aware waiting."""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections.abc import AsyncIterator, Awaitable

import msgspec
import orjson
from starlette.requests import Request
from starlette.responses import Response

from radixlora.errors import InvalidRequestError
from radixlora.server.bridge import ReqFailed

_PATH = re.compile(r"at `\$\.?([^`\[]*)")


class HttpError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param


class ClientGone(Exception):
    """The client disconnected before the answer was ready."""


def json_response(obj, status: int = 200, headers: dict[str, str] | None = None) -> Response:
    return Response(orjson.dumps(obj), status_code=status, media_type="application/json",
                    headers=headers)


def error_body(status: int, message: str, code: str, param: str | None = None) -> dict:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_response(status: int, message: str, code: str, param: str | None = None) -> Response:
    return json_response(error_body(status, message, code, param), status)


def invalid(e: InvalidRequestError) -> HttpError:
    return HttpError(400, e.message, e.code, e.param)


async def read_json(request: Request, schema, max_bytes: int):
    """The body decoded into `schema`, or an HttpError naming the problem."""
    content_type = request.headers.get("content-type", "")
    if "application/json" not in content_type.lower():
        raise HttpError(415, f"expected Content-Type application/json, got {content_type!r}",
                        "unsupported_media_type")
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > max_bytes:
        raise HttpError(413, f"the body exceeds {max_bytes} bytes", "body_too_large")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > max_bytes:
            raise HttpError(413, f"the body exceeds {max_bytes} bytes", "body_too_large")
    try:
        return msgspec.json.decode(bytes(body), type=schema)
    except msgspec.ValidationError as e:
        match = _PATH.search(str(e))
        raise HttpError(400, str(e), "invalid_value", match.group(1) if match else None) from e
    except msgspec.DecodeError as e:
        raise HttpError(400, f"the body is not valid JSON: {e}", "invalid_json") from e


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


async def until_disconnect(request: Request, work: Awaitable):
    """Await `work`; if the client leaves first, cancel it (which aborts its requests) and raise
    ClientGone."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientGone


def sse(obj) -> bytes:
    return b"data: " + orjson.dumps(obj) + b"\n\n"


SSE_DONE = b"data: [DONE]\n\n"


class EventStream:
    """An SSE response. The body generator is cancelled as soon as the client disconnects, so
    its cleanup (aborting the request) runs at once, not at the next write."""

    def __init__(self, body: AsyncIterator[bytes]):
        self.body = body

    async def __call__(self, scope, receive, send) -> None:
        await send({
            "type": "http.response.start",
            "status": 200,
            "headers": [(b"content-type", b"text/event-stream"), (b"cache-control", b"no-cache")],
        })
        stream = asyncio.ensure_future(self._stream(send))
        watcher = asyncio.ensure_future(self._watch(receive))
        done, _ = await asyncio.wait({stream, watcher}, return_when=asyncio.FIRST_COMPLETED)
        if stream in done:
            watcher.cancel()
            stream.result()
            return
        stream.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await stream
        with contextlib.suppress(Exception):
            await self.body.aclose()

    async def _stream(self, send) -> None:
        async for chunk in self.body:
            await send({"type": "http.response.body", "body": chunk, "more_body": True})
        await send({"type": "http.response.body", "body": b"", "more_body": False})

    @staticmethod
    async def _watch(receive) -> None:
        while (await receive())["type"] != "http.disconnect":
            pass


async def stream_body(first: bytes, rest: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
    """The SSE body after its first chunk; a failure once 200 is sent becomes an error event."""
    yield first
    try:
        async for chunk in rest:
            yield chunk
    except ReqFailed as e:
        err = e.error
        yield sse(error_body(err.status, err.message, err.code, err.param))
        yield SSE_DONE
