"""The HTTP app (Starlette routes, orjson responses, OpenAI-shaped errors) over a ProcessBridge."""

from __future__ import annotations

import dataclasses
import functools
import logging
import os
import time

import msgspec
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from radixlora import __version__
from radixlora.config import ModelConfig
from radixlora.errors import InvalidRequestError
from radixlora.protocol.openai import ChatRequest, CompletionRequest
from radixlora.protocol.openai_responses import ResponsesRequest
from radixlora.protocol.sglang import AbortRequest, GenerateRequest
from radixlora.protocol.tools import detect_parser
from radixlora.server.args import ServerArgs
from radixlora.server.http.admin import AdminHandlers
from radixlora.server.http.bridge import (
    DuplicateRequestId,
    Health,
    ProcessBridge,
    ReqFailed,
    ServiceUnavailable,
)
from radixlora.server.http.common import (
    ADMIN,
    Access,
    ClientGone,
    HttpError,
    error_response,
    http_exception,
    json_response,
    read_json,
)
from radixlora.server.http.metrics import Metrics
from radixlora.server.http.openai_api import OpenAIHandlers
from radixlora.server.http.response_store import ResponseStore
from radixlora.server.http.responses_api import (
    ResponsesHandlers,
    delete_response,
    stored_response,
)
from radixlora.server.http.sglang_api import SglangHandlers
from radixlora.server.http.utility_api import UtilityHandlers
from radixlora.text.chat import template_sources

log = logging.getLogger(__name__)
ops_log = logging.getLogger("radixlora.server.http.stats_log")  # the operator lines' logger

CLIENT_CLOSED = 499


def guarded(fn):
    """Turn every expected failure into an OpenAI-shaped error response."""

    @functools.wraps(fn)
    async def wrapper(self, request: Request) -> Response:
        try:
            return await fn(self, request)
        except HttpError as e:
            return self.reject(request, e.status, e.message, e.code, e.param)
        except InvalidRequestError as e:
            return self.reject(request, 400, e.message, e.code, e.param)
        except ReqFailed as e:  # the bridge logged and counted it, as its request
            err = e.error
            return error_response(err.status, err.message, err.code, err.param)
        except DuplicateRequestId as e:
            return self.reject(request, 409, str(e), "duplicate_request_id", "rid")
        except ServiceUnavailable as e:
            return self.reject(request, 503, e.message, "unavailable")
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED)
        except Exception:
            log.exception("unexpected failure in %s", request.url.path)
            return self.reject(request, 500, "internal server error (logged)", "internal_error")

    return wrapper


def tool_parser_of(args: ServerArgs) -> dict:
    """The parser of tool_choice "auto": --tool-call-parser's, else the one the chat templates
    show (None: outputs stay content). Logged once at start."""
    if args.tool_call_parser:
        found = {"name": args.tool_call_parser, "source": "--tool-call-parser"}
    else:
        name = detect_parser(template_sources(args.tokenizer_dir, args.chat_template))
        found = {"name": name, "source": "chat template" if name else None}
    log.info("tool calls (tool_choice auto): %s", f"{found['name']}, from the {found['source']}"
             if found["name"] else "no format recognised in the chat template; outputs are content")
    return found


class Api:
    def __init__(self, args: ServerArgs, runtime: ProcessBridge, metrics: Metrics, vocab_size: int,
                 pids: dict[str, int], sizing: dict | None = None):
        self.args = args
        self.sizing = sizing  # what the worker sized from device memory (CUDA)
        self.runtime = runtime
        self.metrics = metrics
        self.pids = pids
        self.started = time.time()
        self.tool_parser = tool_parser_of(args)
        self.openai = OpenAIHandlers(runtime, args.model_name, vocab_size,
                                     self.tool_parser["name"])
        self.sglang = SglangHandlers(runtime, args.model_name, vocab_size)
        self.response_store = ResponseStore(args.responses_store_bytes, args.responses_store_ttl_s)
        self.responses = ResponsesHandlers(runtime, self.openai, self.response_store)
        self.access = Access(args.api_key, args.admin_api_key, args.enable_admin)
        self.admin = AdminHandlers(args, runtime, self.access)
        self.max_model_len = args.engine_config().max_context(ModelConfig.from_dir(args.model))
        self.utility = UtilityHandlers(args, self.access, vocab_size, self.max_model_len)

    def error(self, status: int, message: str, code: str, param: str | None = None) -> Response:
        self.metrics.on_error(code)
        return error_response(status, message, code, param)

    def reject(self, request: Request, status: int, message: str, code: str,
               param: str | None = None) -> Response:
        """An error answered before any request reached the other processes: with
        --log-requests, its line (method, path, status, code, param; never the message, which
        may quote the body)."""
        if self.args.log_requests:
            ops_log.info("rejected %s %s status=%d code=%s%s", request.method, request.url.path,
                         status, code, f" param={param}" if param else "")
        return self.error(status, message, code, param)

    def app(self) -> Starlette:
        routes = [
            Route("/health", self.health, methods=["GET"]),
            Route("/health_generate", self.health, methods=["GET"]),
            Route("/metrics", self.prometheus, methods=["GET"]),
            Route("/v1/models", self.models, methods=["GET"]),
            Route("/v1/models/{model_id:path}", self.model, methods=["GET"]),
            Route("/v1/completions", self.completions, methods=["POST"]),
            Route("/v1/chat/completions", self.chat, methods=["POST"]),
            Route("/v1/responses", self.create_response, methods=["POST"]),
            Route("/v1/responses/{response_id}", self.get_response, methods=["GET"]),
            Route("/v1/responses/{response_id}", self.delete_response, methods=["DELETE"]),
            Route("/generate", self.generate, methods=["POST"]),
            Route("/get_model_info", self.model_info, methods=["GET"]),
            Route("/tokenize", self.tokenize, methods=["POST"]),
            Route("/detokenize", self.detokenize, methods=["POST"]),
            Route("/version", self.utility.version, methods=["GET"]),
            Route("/get_server_info", self.server_info, methods=["GET"]),
            Route("/server_info", self.server_info, methods=["GET"]),
            Route("/flush_cache", self.flush_cache, methods=["POST"]),
            Route("/abort_request", self.abort_request, methods=["POST"]),
            Route("/v1/load_lora_adapter", self.load_lora, methods=["POST"]),
            Route("/v1/unload_lora_adapter", self.unload_lora, methods=["POST"]),
            Route("/load_lora_adapter", self.sglang_load_lora, methods=["POST"]),
            Route("/unload_lora_adapter", self.sglang_unload_lora, methods=["POST"]),
            Route("/v1/pin_lora_adapter", self.pin_lora, methods=["POST"]),
            Route("/v1/unpin_lora_adapter", self.unpin_lora, methods=["POST"]),
        ]
        handlers = {HTTPException: http_exception}
        return Starlette(routes=routes, exception_handlers=handlers)

    # ---- endpoints ---------------------------------------------------------------------------

    async def health(self, request: Request) -> Response:
        health = self.runtime.health
        degraded = self.runtime.degraded_reason
        if health is Health.OK:
            body = ({"status": "ok"} if degraded is None
                    else {"status": "degraded", "reason": degraded})
            if self.runtime.rejected:  # refused adapters: said, serving is not degraded by them
                body["adapters_rejected"] = dict(sorted(self.runtime.rejected.items()))
            return json_response(body)
        message = self.runtime.dead_reason or f"the server is {health.value}"
        return error_response(503, message, health.value)

    async def prometheus(self, request: Request) -> Response:
        return Response(self.metrics.render(), media_type="text/plain; version=0.0.4")

    @guarded
    async def models(self, request: Request) -> Response:
        self.access.identity(request)
        return json_response({"object": "list", "data": await self._model_cards()})

    @guarded
    async def model(self, request: Request) -> Response:
        """One card of /v1/models (the base or an adapter), as OpenAI's retrieve-model."""
        self.access.identity(request)
        wanted = request.path_params["model_id"]
        card = next((c for c in await self._model_cards() if c["id"] == wanted), None)
        if card is None:
            return self.error(404, f"The model '{wanted}' does not exist", "model_not_found",
                              "model")
        return json_response(card)

    async def _model_cards(self) -> list[dict]:
        info = await self.runtime.query_info()
        base = self.args.model_name
        created = int(self.started)
        data = [{"id": base, "object": "model", "created": created, "owned_by": "radixlora",
                 "root": self.args.model, "parent": None, "max_model_len": self.max_model_len}]
        served = [
            {"id": a["name"], "object": "model", "created": created, "owned_by": "radixlora",
             "root": a["path"], "parent": base, "max_model_len": self.max_model_len,
             "adapter_id": a["adapter_id"], "rank": a["rank"], "dora": a["dora"],
             "status": "ready"}
            for a in info["adapters"]
        ]
        names = {a["name"] for a in info["adapters"]}
        validating = [  # listed from --adapter-dir: a request for one waits for its validation
            {"id": name, "object": "model", "created": created, "owned_by": "radixlora",
             "root": None, "parent": base, "max_model_len": self.max_model_len,
             "status": "validating"}
            for name in sorted(self.runtime.listed - names)
        ]
        return data + served + validating

    async def accepted(self, request: Request, schema):
        """(the caller's identity, the body decoded into `schema`) of a generation request,
        once the key is checked and the server is accepting work."""
        owner = self.access.identity(request)
        self.runtime.check_accepting()
        return owner, await read_json(request, schema, self.args.max_body_bytes)

    @guarded
    async def completions(self, request: Request) -> Response:
        owner, req = await self.accepted(request, CompletionRequest)
        return await self.openai.completions(request, req, owner)

    @guarded
    async def chat(self, request: Request) -> Response:
        owner, req = await self.accepted(request, ChatRequest)
        return await self.openai.chat(request, req, owner)

    @guarded
    async def create_response(self, request: Request) -> Response:
        owner, req = await self.accepted(request, ResponsesRequest)
        return await self.responses.create(request, req, owner)

    @guarded
    async def get_response(self, request: Request) -> Response:
        owner = self.access.identity(request)
        return await stored_response(self.response_store, request.path_params["response_id"],
                                     owner)

    @guarded
    async def delete_response(self, request: Request) -> Response:
        owner = self.access.identity(request)
        return await delete_response(self.response_store, request.path_params["response_id"],
                                     owner)

    @guarded
    async def generate(self, request: Request) -> Response:
        owner, req = await self.accepted(request, GenerateRequest)
        return await self.sglang.generate(request, req, owner)

    @guarded
    async def model_info(self, request: Request) -> Response:
        self.access.identity(request)
        return json_response({
            "model_path": self.args.model,
            "tokenizer_path": self.args.tokenizer_dir,
            "served_model_name": self.args.model_name,
            "is_generation": True,
        })

    @guarded
    async def server_info(self, request: Request) -> Response:
        self.access.admin(request)
        scheduler = await self.runtime.query_info()
        return json_response({
            "version": __version__,
            "model_path": self.args.model,
            "served_model_name": self.args.model_name,
            "host": self.args.host,
            "port": self.args.port,
            "engine": dataclasses.asdict(self.args.engine_config()),
            "sizing": self.sizing,
            "zmq_client_endpoint": self.args.endpoints.client,
            "zmq_endpoints": msgspec.structs.asdict(self.args.endpoints),
            "pids": {"api": os.getpid(), **self.pids},
            "health": self.runtime.health.value,
            "degraded_reason": self.runtime.degraded_reason,
            "adapter_events": [msgspec.structs.asdict(e) for e in self.runtime.recent_events],
            "open_generations": len(self.runtime.generations),
            "scheduler": scheduler,
            "data_parallel_size": self.runtime.num_replicas,
            "router": self._router_info(),
            "tool_call_parser": self.tool_parser,
        })

    def _router_info(self) -> dict | None:
        """The router's last report (replicas > 1), with each replica's radix hit counters."""
        stats = self.runtime.router_stats
        if stats is None:
            return None
        replicas = self.runtime.replica_stats
        hits = {str(r): {"prompt_tokens": s.prompt_tokens, "cached_tokens": s.cached_tokens}
                for r, s in sorted(replicas.items())}
        return {**msgspec.structs.asdict(stats), "radix": hits}

    @guarded
    async def flush_cache(self, request: Request) -> Response:
        self.access.admin(request)
        info = await self.runtime.query_info(flush_cache=True)
        return json_response({"kv_free_tokens": info["kv_free_tokens"]})

    @guarded
    async def abort_request(self, request: Request) -> Response:
        caller = self.access.aborter(request)
        body = await read_json(request, AbortRequest, self.args.max_body_bytes)
        rid = body.rid
        if not rid:
            raise InvalidRequestError("rid must be a non-empty string", param="rid")
        if not self.runtime.cancel(rid, None if caller == ADMIN else caller):
            raise HttpError(404, f"no request with id {rid!r} is in flight", "unknown_request_id",
                            "rid")
        return json_response({"aborted": rid})

    @guarded
    async def load_lora(self, request: Request) -> Response:
        return await self.admin.load(request)

    @guarded
    async def unload_lora(self, request: Request) -> Response:
        return await self.admin.unload(request)

    @guarded
    async def sglang_load_lora(self, request: Request) -> Response:
        return await self.admin.load(request, sglang=True)

    @guarded
    async def sglang_unload_lora(self, request: Request) -> Response:
        return await self.admin.unload(request, sglang=True)

    @guarded
    async def tokenize(self, request: Request) -> Response:
        return await self.utility.tokenize(request)

    @guarded
    async def detokenize(self, request: Request) -> Response:
        return await self.utility.detokenize(request)

    @guarded
    async def pin_lora(self, request: Request) -> Response:
        return await self.admin.pin(request)

    @guarded
    async def unpin_lora(self, request: Request) -> Response:
        return await self.admin.unpin(request)
