"""Admin endpoints (off unless --enable-admin, Bearer --admin-api-key): vLLM's
POST /v1/load_lora_adapter {"lora_name", "lora_path"} and /v1/unload_lora_adapter {"lora_name"},
SGLang's /load_lora_adapter {"lora_name", "lora_path", "pinned"} and /unload_lora_adapter
(the same, answering "success" too), plus /v1/pin_lora_adapter and /v1/unpin_lora_adapter
{"lora_name"}. A load of a name given at start (--adapter) is a 409 unless it says
"replace": true. A lora_path must resolve (symlinks followed) inside one of
--allowed-adapter-root."""

from __future__ import annotations

import os
from pathlib import Path

import msgspec
from starlette.requests import Request

from radixlora.protocol.common import Int32
from radixlora.server.args import ServerArgs
from radixlora.server.http.bridge import ProcessBridge
from radixlora.server.http.common import Access, HttpError, json_response, read_json


class LoadLoraRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_path: str
    lora_int_id: Int32 | None = None  # accepted for vLLM compatibility, unused
    pinned: bool = False  # SGLang's: pin it once loaded
    replace: bool = False  # replace an adapter of this name given at start (--adapter)


class LoraNameRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: Int32 | None = None


def confine(path: str, roots: list[str]) -> str:
    """The real path of `path` if it lies inside an allowed root, else a 4xx HttpError. A
    relative path is taken relative to the first root."""
    if not roots:
        raise HttpError(403, "no --allowed-adapter-root is configured: adapters cannot be "
                        "loaded over HTTP", "path_not_allowed", "lora_path")
    if not path or "\0" in path or len(path) > 4096:
        raise HttpError(400, "lora_path must be a non-empty path", "invalid_path", "lora_path")
    if ".." in Path(path).parts:
        raise HttpError(400, "lora_path may not contain '..'", "invalid_path", "lora_path")
    candidate = Path(path) if os.path.isabs(path) else Path(roots[0]) / path
    real = os.path.realpath(candidate)
    for root in roots:
        real_root = os.path.realpath(root)
        if real == real_root or real.startswith(real_root.rstrip(os.sep) + os.sep):
            return real
    raise HttpError(403, f"lora_path {path!r} resolves outside the allowed adapter roots",
                    "path_not_allowed", "lora_path")


class AdminHandlers:
    def __init__(self, args: ServerArgs, runtime: ProcessBridge, access: Access):
        self.args = args
        self.runtime = runtime
        self.access = access

    def check_access(self, request: Request) -> None:
        self.access.admin(request)

    async def load(self, request: Request, sglang: bool = False):
        self.check_access(request)
        body = await read_json(request, LoadLoraRequest, self.args.max_body_bytes)
        path = confine(body.lora_path, self.args.allowed_adapter_roots)
        info = await self._call("load", body.lora_name, path, body.replace)
        if body.pinned:
            await self._call("pin", body.lora_name)
            info = {**info, "pinned": True}
        return self._answer(info, sglang)

    async def unload(self, request: Request, sglang: bool = False):
        self.check_access(request)
        body = await read_json(request, LoraNameRequest, self.args.max_body_bytes)
        return self._answer(await self._call("unload", body.lora_name), sglang)

    async def pin(self, request: Request):
        return await self._named(request, "pin")

    async def unpin(self, request: Request):
        return await self._named(request, "unpin")

    async def _named(self, request: Request, op: str):
        self.check_access(request)
        body = await read_json(request, LoraNameRequest, self.args.max_body_bytes)
        return self._answer(await self._call(op, body.lora_name))

    async def _call(self, op: str, name: str, path: str = "", replace: bool = False) -> dict:
        reply = await self.runtime.admin(op, name, path, replace)
        if reply.status != 200:
            raise HttpError(reply.status, reply.message, reply.code, reply.param)
        return {"status": "ok", "op": op, **reply.info}

    @staticmethod
    def _answer(info: dict, sglang: bool = False):
        """vLLM's routes answer the op's info; SGLang's add its `success` field."""
        return json_response({"success": True, **info} if sglang else info)
