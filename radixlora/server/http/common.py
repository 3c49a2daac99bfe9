"""HTTP helpers: orjson responses, OpenAI-shaped errors, JSON bodies validated with msgspec, an
SSE response that watches for the client leaving, and disconnect-aware waiting."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import re
from collections.abc import AsyncIterator, Awaitable, Callable

import msgspec
import numpy as np
import orjson
from starlette.requests import Request
from starlette.responses import Response

from radixlora.errors import InvalidRequestError
from radixlora.protocol.common import unknown_fields
from radixlora.server.http.bridge import Generation, ReqFailed

_PATH = re.compile(r"at `\$\.?([^`\[]*)")
MAX_DEPTH = 64  # nesting of JSON arrays and objects in a request body
OFF_LOOP_ENTRIES = 10_000  # logprob entries past which an answer is built off the event loop
PIECE = 2048  # list items serialized at a time there
_OPEN, _CLOSE, _QUOTE, _BACKSLASH = 1, 2, 3, 4
_CLASS = np.zeros(256, np.int8)
_CLASS[[ord("["), ord("{")]] = _OPEN
_CLASS[[ord("]"), ord("}")]] = _CLOSE
_CLASS[ord('"')] = _QUOTE
_CLASS[ord("\\")] = _BACKSLASH


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


async def json_answer(build: Callable[[], object], gens: list[Generation],
                      headers: dict[str, str] | None = None) -> Response:
    """json_response(build()), the answer of `gens`; one of more than OFF_LOOP_ENTRIES logprob
    entries is built and serialized on a thread, a piece at a time (dumps_in_pieces), so that
    the event loop goes on serving /health and every other stream meanwhile."""
    if sum(gen.logprob_entries for gen in gens) <= OFF_LOOP_ENTRIES:
        return json_response(build(), headers=headers)
    body = await asyncio.to_thread(lambda: dumps_in_pieces(build()))
    return Response(body, media_type="application/json", headers=headers)


def dumps_in_pieces(obj) -> bytes:
    """orjson.dumps(obj), lists of more than PIECE items serialized PIECE items at a time:
    orjson holds the GIL for a whole call, Python code between calls lets it go."""
    return orjson.dumps(_in_pieces(obj))


def _in_pieces(obj):
    if isinstance(obj, dict):
        return {k: _in_pieces(v) for k, v in obj.items()}
    if not isinstance(obj, list):
        return obj
    if len(obj) <= PIECE:
        return [_in_pieces(v) for v in obj]
    parts = [orjson.dumps(obj[i:i + PIECE])[1:-1] for i in range(0, len(obj), PIECE)]
    return orjson.Fragment(b"[" + b",".join(parts) + b"]")


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
    raw = bytes(body)
    if json_depth(raw) > MAX_DEPTH:
        raise HttpError(400, f"the body nests arrays and objects deeper than {MAX_DEPTH} levels",
                        "too_deep")
    try:
        return msgspec.json.decode(raw, type=schema)
    except RecursionError as e:
        raise HttpError(400, "the body nests too deeply", "too_deep") from e
    except msgspec.ValidationError as e:
        names = unknown_fields(raw, schema) if "unknown field" in str(e) else []
        if names:
            raise HttpError(400, f"unrecognized request arguments: {', '.join(names)}",
                            "unknown_parameter", names[0]) from e
        match = _PATH.search(str(e))
        raise HttpError(400, str(e), "invalid_value", match.group(1) if match else None) from e
    except msgspec.DecodeError as e:
        raise HttpError(400, f"the body is not valid JSON: {e}", "invalid_json") from e


def json_depth(raw: bytes) -> int:
    """The deepest nesting of arrays and objects in `raw`, brackets inside strings not counted,
    computed with array operations over the bytes that matter (brackets, quotes, backslashes)."""
    if raw.count(b"[") + raw.count(b"{") <= MAX_DEPTH:
        return 0
    kinds = _CLASS[np.frombuffer(raw, np.uint8)]
    at = np.flatnonzero(kinds)
    kinds = kinds[at]
    n = len(at)
    slash = kinds == _BACKSLASH
    adjacent = np.zeros(n, bool)
    adjacent[1:] = np.diff(at) == 1
    continues = np.zeros(n, bool)
    continues[1:] = slash[1:] & slash[:-1] & adjacent[1:]
    index = np.arange(n, dtype=np.int32)
    run_start = np.maximum.accumulate(np.where(slash & ~continues, index, 0))
    odd_run = slash & ((index - run_start) & 1 == 0)  # an odd run of backslashes ends here
    escaped = np.zeros(n, bool)
    escaped[1:] = odd_run[:-1] & adjacent[1:]
    quote = (kinds == _QUOTE) & ~escaped
    outside = np.bitwise_xor.accumulate(quote) == 0
    steps = ((kinds == _OPEN).astype(np.int8) - (kinds == _CLOSE)) * outside
    return int(np.cumsum(steps, dtype=np.int32).max(initial=0))


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


ANONYMOUS = ""  # the identity of every request when no --api-key is set
ADMIN = "admin"  # the identity of the admin key: it may abort any request


def key_identity(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


class Access:
    """Who may call what. With an API key every endpoint but the health checks and /metrics
    needs `Authorization: Bearer KEY` (the admin key is accepted too); a request's identity is
    a hash of the key it came with. The admin endpoints, /flush_cache and /get_server_info
    need the admin key when admin is enabled and do not exist (404) otherwise."""

    def __init__(self, api_key: str, admin_key: str | None, enable_admin: bool):
        self.api_key = api_key.encode()
        self.admin_key = (admin_key or "").encode() if enable_admin else b""

    def identity(self, request: Request) -> str:
        """The caller's identity on an endpoint guarded by the API key, else a 401."""
        token = bearer(request)
        if self.is_admin(token):
            return ADMIN
        if not self.api_key:
            return ANONYMOUS
        if token is not None and hmac.compare_digest(token, self.api_key):
            return key_identity(self.api_key.decode())
        raise HttpError(401, "a valid API key is required (Authorization: Bearer KEY)",
                        "invalid_api_key")

    def admin(self, request: Request) -> None:
        """An admin-only endpoint: a 404 when admin is off, a 401 without the admin key."""
        if not self.admin_key:
            raise HttpError(404, "this endpoint is disabled (start with --enable-admin)",
                            "not_found")
        if not self.is_admin(bearer(request)):
            raise HttpError(401, "a valid admin API key is required (Authorization: Bearer "
                            "ADMIN_KEY)", "invalid_api_key")

    def aborter(self, request: Request) -> str:
        """Whose requests the caller of /abort_request may abort: the admin's, any; an API
        key's, its own. With neither key configured there is no one to ask, so it is a 404."""
        if not self.api_key:
            self.admin(request)
            return ADMIN
        return self.identity(request)

    def is_admin(self, token: bytes | None) -> bool:
        return bool(self.admin_key) and token is not None and hmac.compare_digest(
            token, self.admin_key)


def bearer(request: Request) -> bytes | None:
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    return token.strip().encode() if scheme.lower() == "bearer" else None


def http_exception(request: Request, exc: Exception) -> Response:
    """Starlette's own errors (unknown route, wrong method) in the OpenAI shape."""
    status = getattr(exc, "status_code", 500)
    headers = getattr(exc, "headers", None)
    if status == 404:
        message, code = f"no endpoint {request.url.path}", "not_found"
    elif status == 405:
        message = f"{request.method} is not allowed on {request.url.path}"
        code = "method_not_allowed"
    else:
        message, code = str(getattr(exc, "detail", "")) or "request failed", "http_error"
    return json_response(error_body(status, message, code), status, headers)
