"""Offline batch runs over a JSONL file in the OpenAI batch format.

Each input line is {"custom_id", "method": "POST", "url": "/v1/completions" or
"/v1/chat/completions", "body"}; `body` is the endpoint's request, its adapters named as on the
server: "model": "BASE:ADAPTER" or "ADAPTER", or "model": BASE plus
"adapters": [{"name", "weight"}, ...] for a weighted stack. Each output line is

    {"id", "custom_id", "response": {"status_code", "request_id", "body"}, "error": null}

or, for a line that cannot be served, {"id", "custom_id", "response": null,
"error": {"message", "code"}}; the run goes on. A line without a usable custom_id (not JSON,
missing, or repeating an earlier line's) is reported under "line-N" (its 1-based line number).

Runs are resumable: custom_ids already in the output file are skipped (a half-written last line
left by a killed run is dropped first). Requests run on the in-process Engine (through
frontend.Runtime, so many lines share each batch) or against a server URL. Failures that are
not the line's fault (the server unreachable or answering 5xx, the engine failing) stop the run
instead of being written, so that a resumed run retries them. The command line is
radixlora.cli.batch."""

from __future__ import annotations

import contextlib
import json
import threading
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import msgspec
from tqdm.auto import tqdm

from radixlora.engine import Engine
from radixlora.errors import AdapterError, InvalidRequestError
from radixlora.protocol.common import completion_prompts, stop_list
from radixlora.protocol.openai import (
    ChatRequest,
    CompletionRequest,
    chat_messages,
    chat_params,
    completion_params,
    request_adapters,
)
from radixlora.protocol.responses import (
    chat_choice,
    chat_logprobs,
    completion_choice,
    completion_logprobs,
    response_head,
    usage,
)
from radixlora.sampling_params import SamplingParams
from radixlora.sched.prompt_limits import fill_context, max_total_tokens
from radixlora_frontend.backend import GenResult
from radixlora_frontend.endpoint import http_client, http_error
from radixlora_frontend.runtime import Runtime

URLS = ("/v1/completions", "/v1/chat/completions")
DEFAULT_CONCURRENCY = 64


class LineError(Exception):
    """The line cannot be served: becomes the line's error record."""

    def __init__(self, message: str, code: str):
        super().__init__(message)
        self.message = message
        self.code = code


@dataclass(frozen=True)
class BatchLine:
    lineno: int
    custom_id: str
    url: str
    body: dict


@dataclass(frozen=True)
class BadLine:
    lineno: int
    custom_id: str
    error: LineError


@dataclass
class BatchSummary:
    total: int = 0  # request lines in the input
    skipped: int = 0  # already in the output before this run
    succeeded: int = 0
    failed: int = 0  # error records written by this run


Client = Callable[[str, dict], dict]  # (url, body) -> response body; raises LineError


# ---- input and output ------------------------------------------------------------------------


def read_lines(path: str | Path) -> list[BatchLine | BadLine]:
    """Every non-blank line of the input, parsed, in order."""
    seen: set[str] = set()
    lines: list[BatchLine | BadLine] = []
    with open(path, encoding="utf-8") as f:
        for lineno, raw in enumerate(f, 1):
            if raw.strip():
                lines.append(parse_line(lineno, raw, seen))
    return lines


def parse_line(lineno: int, raw: str, seen: set[str]) -> BatchLine | BadLine:
    fallback = f"line-{lineno}"
    try:
        obj = json.loads(raw)
    except ValueError as e:
        return BadLine(
            lineno, fallback, LineError(f"line {lineno} is not JSON: {e}", "invalid_json")
        )
    if not isinstance(obj, dict):
        return BadLine(
            lineno, fallback, LineError("a line must be a JSON object", "invalid_request")
        )
    custom_id = obj.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return BadLine(
            lineno, fallback, LineError("custom_id must be a non-empty string", "missing_custom_id")
        )
    if custom_id in seen:
        return BadLine(
            lineno,
            fallback,
            LineError(f"custom_id {custom_id!r} is repeated", "duplicate_custom_id"),
        )
    seen.add(custom_id)
    error = _request_error(obj)
    if error is not None:
        return BadLine(lineno, custom_id, error)
    return BatchLine(lineno, custom_id, obj["url"], obj["body"])


def _request_error(obj: dict) -> LineError | None:
    if obj.get("method", "POST") != "POST":
        return LineError(f"method must be POST, got {obj.get('method')!r}", "invalid_method")
    if obj.get("url") not in URLS:
        return LineError(f"url must be one of {list(URLS)}, got {obj.get('url')!r}", "invalid_url")
    if not isinstance(obj.get("body"), dict):
        return LineError("body must be a JSON object", "invalid_request")
    return None


def completed_ids(path: str | Path) -> set[str]:
    """custom_ids already answered in an output file; drops a half-written last line."""
    path = Path(path)
    if not path.exists():
        return set()
    data = path.read_bytes()
    end = data.rfind(b"\n") + 1
    if end < len(data):
        with open(path, "r+b") as f:
            f.truncate(end)
    ids = set()
    for raw in data[:end].splitlines():
        try:
            ids.add(json.loads(raw)["custom_id"])
        except (ValueError, KeyError, TypeError):
            continue
    return ids


def success_record(custom_id: str, body: dict) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": {"status_code": 200, "request_id": body.get("id"), "body": body},
        "error": None,
    }


def error_record(custom_id: str, error: LineError) -> dict:
    return {
        "id": f"batch_req_{uuid.uuid4().hex}",
        "custom_id": custom_id,
        "response": None,
        "error": {"message": error.message, "code": error.code},
    }


class _Writer:
    """Appends records, one whole line per write, flushed at once (safe to kill)."""

    def __init__(self, path: str | Path, bar: tqdm, summary: BatchSummary):
        self.file = open(path, "a", encoding="utf-8")  # noqa: SIM115 (closed by close())
        self.lock = threading.Lock()
        self.bar = bar
        self.summary = summary

    def write(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=False) + "\n"
        with self.lock:
            self.file.write(line)
            self.file.flush()
            if record["error"] is None:
                self.summary.succeeded += 1
            else:
                self.summary.failed += 1
            self.bar.update(1)

    def close(self) -> None:
        self.file.close()


# ---- the run -----------------------------------------------------------------------------------


def run_batch(
    input_path: str | Path,
    output_path: str | Path,
    engine_or_url: Engine | Runtime | str,
    progress: bool = True,
    concurrency: int = DEFAULT_CONCURRENCY,
    model_name: str | None = None,
) -> BatchSummary:
    """Answer every line of input_path not yet in output_path, appending to output_path.
    `engine_or_url`: an Engine (or a running frontend Runtime) or a server's base URL.
    `model_name`: the base model's name in "model" (in-process default: the model directory's
    name, as `radixlora serve` calls it)."""
    lines = read_lines(input_path)
    done = completed_ids(output_path)
    todo = [line for line in lines if line.custom_id not in done]
    summary = BatchSummary(total=len(lines), skipped=len(lines) - len(todo))
    with (
        open_client(engine_or_url, model_name) as client,
        tqdm(total=len(lines), initial=summary.skipped, disable=not progress, desc="batch") as bar,
    ):
        writer = _Writer(output_path, bar, summary)
        try:
            _run_lines(todo, client, writer, concurrency)
        finally:
            writer.close()
    return summary


def _run_lines(
    lines: list[BatchLine | BadLine], client: Client, writer: _Writer, concurrency: int
) -> None:
    """Bad lines are written at once; the others run `concurrency` at a time. The first failure
    that is not a line's fault stops the submission of further lines and is raised."""
    slots = threading.Semaphore(concurrency)
    failures: list[BaseException] = []

    def finished(future: Future) -> None:
        if future.exception() is not None:
            failures.append(future.exception())
        slots.release()

    with ThreadPoolExecutor(concurrency) as pool:
        for line in lines:
            if failures:
                break
            if isinstance(line, BadLine):
                writer.write(error_record(line.custom_id, line.error))
                continue
            slots.acquire()
            pool.submit(_answer, line, client, writer).add_done_callback(finished)
    if failures:
        raise failures[0]


def _answer(line: BatchLine, client: Client, writer: _Writer) -> None:
    try:
        record = success_record(line.custom_id, client(line.url, line.body))
    except LineError as e:
        record = error_record(line.custom_id, e)
    writer.write(record)


@contextlib.contextmanager
def open_client(engine_or_url, model_name: str | None = None) -> Iterator[Client]:
    """The Client for an Engine, a running Runtime or a URL; a Runtime started here for an
    Engine is shut down at exit (the Engine stays usable)."""
    if isinstance(engine_or_url, str):
        with contextlib.closing(HttpClient(engine_or_url)) as client:
            yield client
        return
    if isinstance(engine_or_url, Runtime):
        yield EngineClient(engine_or_url, model_name)
        return
    with Runtime(engine_or_url) as runtime:
        yield EngineClient(runtime, model_name)


# ---- in-process requests -------------------------------------------------------------------------


def _spec(choices) -> list[tuple[str, float]] | None:
    return [(c.name, c.weight) for c in choices] if choices else None


class EngineClient:
    """Serves /v1/completions and /v1/chat/completions bodies on a Runtime, with the server's
    validation (radixlora.protocol.openai) and response bodies (radixlora.protocol.responses)."""

    def __init__(self, runtime: Runtime, model_name: str | None = None):
        self.runtime = runtime
        engine = runtime.engine
        self.model_name = model_name or engine.model_path.resolve().name
        self.vocab_size = engine.model_cfg.vocab_size
        self.max_total = max_total_tokens(engine.model_cfg, engine.config)

    def __call__(self, url: str, body: dict) -> dict:
        try:
            if url == "/v1/chat/completions":
                return self.chat(msgspec.convert(body, ChatRequest))
            return self.completions(msgspec.convert(body, CompletionRequest))
        except msgspec.ValidationError as e:
            raise LineError(str(e), "invalid_request") from None
        except InvalidRequestError as e:
            raise LineError(e.message, e.code) from None
        except AdapterError as e:
            raise LineError(str(e), e.code) from None

    def completions(self, req: CompletionRequest) -> dict:
        _no_stream(req.stream)
        _default_text_options(req)
        params = completion_params(req, self.vocab_size)
        stops = stop_list(req.stop)
        prompts = [self._ids(p) for p in completion_prompts(req.prompt)]
        choices = request_adapters(req, self.model_name, len(prompts))
        futures = [
            self.runtime.submit(ids, self._params(params, ids, req.max_tokens), _spec(c), stops)
            for ids, c in zip(prompts, choices)
        ]
        results = [f.result() for f in futures]
        choices = [
            completion_choice(
                p * req.n + i,
                r.text,
                self._completion_logprobs(r, req.return_tokens_as_token_ids)
                if req.logprobs is not None else None,
                r.finish_reason,
            )
            for p, samples in enumerate(results)
            for i, r in enumerate(samples)
        ]
        return _body("cmpl", "text_completion", req.model, choices, results)

    def chat(self, req: ChatRequest) -> dict:
        _no_stream(req.stream)
        _default_text_options(req)
        params, tools = chat_params(req, self.vocab_size)
        adapters = _spec(request_adapters(req, self.model_name)[0])
        text = self.runtime.chat_template.prompt(
            [m.as_dict() for m in chat_messages(req.messages)], req.add_generation_prompt,
            req.continue_final_message, req.chat_template_kwargs, req.tools or None)
        ids = self.runtime.engine.tokenizer.encode(text, add_special_tokens=False)
        max_tokens = req.max_tokens if req.max_completion_tokens is None else (
            req.max_completion_tokens)
        future = self.runtime.submit(
            ids, self._params(params, ids, max_tokens), adapters, stop_list(req.stop)
        )
        samples = future.result()
        choices = []
        for i, r in enumerate(samples):
            message, finish_reason = tools.message(r.text, r.finish_reason)
            logprobs = (self._chat_logprobs(r, req.return_tokens_as_token_ids) if req.logprobs
                        else None)
            choices.append(chat_choice(i, message, logprobs, finish_reason))
        return _body("chatcmpl", "chat.completion", req.model, choices, [samples])

    def _ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, list):
            return prompt
        tok = self.runtime.engine.tokenizer
        if tok is None:
            raise InvalidRequestError(
                "this model has no tokenizer.json; send token ids", param="prompt"
            )
        return tok.encode(prompt)

    def _params(self, params: SamplingParams, ids: list[int], max_tokens: int | None):
        """max_tokens omitted: what the context leaves after the prompt (as the server does)."""
        return params if max_tokens is not None else fill_context(params, len(ids), self.max_total)

    def _token_text(self, token_id: int, as_id: bool) -> str:
        """as_id: vLLM's return_tokens_as_token_ids, "token_id:N"."""
        if as_id:
            return f"token_id:{token_id}"
        return self.runtime.engine.tokenizer.decode([token_id], skip_special_tokens=False)

    def _texts_and_top(self, r: GenResult,
                       as_ids: bool) -> tuple[list[str], list[list[tuple[str, float]]]]:
        texts = [self._token_text(t, as_ids) for t in r.token_ids]
        top = [[(self._token_text(t, as_ids), lp) for t, lp in row] for row in r.top_logprobs]
        return texts, top

    def _completion_logprobs(self, r: GenResult, as_ids: bool) -> dict:
        texts, top = self._texts_and_top(r, as_ids)
        return completion_logprobs(texts, r.logprobs, top)

    def _chat_logprobs(self, r: GenResult, as_ids: bool) -> dict:
        texts, top = self._texts_and_top(r, as_ids)
        return chat_logprobs(texts, r.logprobs, top)


def _default_text_options(req) -> None:
    """The server's text options the offline Runtime does not have yet: refused, not ignored."""
    for field, default in (("skip_special_tokens", True), ("include_stop_str_in_output", False)):
        if getattr(req, field) != default:
            raise InvalidRequestError(f"{field} is not supported in batch runs yet",
                                      param=field, code="unsupported_parameter")


def _no_stream(stream: bool) -> None:
    if stream:
        raise InvalidRequestError("stream is not supported in batch runs", param="stream")


def _body(
    prefix: str, kind: str, model: str, choices: list[dict], results: list[list[GenResult]]
) -> dict:
    return {
        **response_head(prefix, kind, model),
        "choices": choices,
        "usage": usage(
            sum(samples[0].prompt_tokens for samples in results),
            sum(r.completion_tokens for samples in results for r in samples),
            sum(samples[0].cached_tokens for samples in results),
        ),
    }


# ---- requests to a server ----------------------------------------------------------------------


class HttpClient:
    """POSTs each body to the server; a 4xx answer is the line's error, anything else raises."""

    def __init__(self, base_url: str, api_key: str | None = None, timeout_s: float = 600.0):
        self.http = http_client(base_url.rstrip("/"), api_key, timeout_s)

    def __call__(self, url: str, body: dict) -> dict:
        resp = self.http.post(url, content=json.dumps(body).encode())
        if resp.is_success:
            return resp.json()
        error = http_error(resp.status_code, resp.content)
        if 400 <= resp.status_code < 500:
            raise LineError(error.message, error.code or "invalid_request")
        raise error

    def close(self) -> None:
        self.http.close()
