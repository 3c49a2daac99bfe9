"""HTTP backend: a running `radixlora serve` (or any server speaking SGLang's native /generate).

Contract used (SGLang's RuntimeEndpoint contract, plus one radixlora extension):
- generate: POST /generate {"text", "sampling_params": {max_new_tokens, temperature, top_p,
  top_k, min_p, stop, stop_token_ids, ignore_eos, sampling_seed}, "stream"} -> {"text",
  "output_ids", "meta_info": {"finish_reason": {"type", "matched"}, "prompt_tokens",
  "completion_tokens", "cached_tokens"}}; with "stream": true, SSE `data: {...}` events whose
  "text" is cumulative, then `data: [DONE]`;
- adapters: one adapter as "lora_path": name (SGLang); a weighted stack as the extension
  "adapters": [{"name", "weight"}, ...] (the field /v1/completions already takes);
- select: POST /generate {"text": prompt, max_new_tokens 0} gives the prompt's token count N
  (and caches the prompt), then POST /generate {"text": [prompt + choice, ...],
  max_new_tokens 0, "return_logprob": true, "logprob_start_len": N}; each answer's
  meta_info.input_token_logprobs ([logprob, token_id, text] per token from position N) scores
  the choice, exactly as the in-process Runtime scores it;
- chat template: GET /get_model_info gives "model_path"; its tokenizer_config.json is used when
  that directory exists on this machine, the fallback template otherwise (or pass one)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx

from radixlora.errors import RadixLoraError
from radixlora.text.chat import DEFAULT_CHAT_TEMPLATE, ChatTemplate

from .backend import Backend, GenResult, TextCallback
from .ir import AdapterSpec, GenParams


class EndpointError(RadixLoraError):
    """The server refused a request (status, OpenAI-style code) or broke the contract."""

    def __init__(self, status: int, message: str, code: str | None = None):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status
        self.message = message
        self.code = code


class RuntimeEndpoint(Backend):
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        timeout_s: float = 600.0,
        chat_template: ChatTemplate | str | None = None,
    ):
        self.base_url = base_url.rstrip("/")
        self.api_key = api_key
        self.timeout_s = timeout_s
        self._http = http_client(self.base_url, api_key, timeout_s)
        if isinstance(chat_template, str):
            chat_template = ChatTemplate(chat_template)
        self._template = chat_template
        self._template_lock = threading.Lock()

    @property
    def chat_template(self) -> ChatTemplate:
        with self._template_lock:
            if self._template is None:
                self._template = self._server_template()
            return self._template

    def _server_template(self) -> ChatTemplate:
        info = self.get_model_info()
        path = info.get("tokenizer_path") or info.get("model_path")
        if path and Path(path).is_dir():
            return ChatTemplate.from_dir(path)
        return ChatTemplate(DEFAULT_CHAT_TEMPLATE)

    def get_model_info(self) -> dict:
        with self._open("GET", "/get_model_info") as resp:
            return json.loads(resp.read())

    def close(self) -> None:
        """Close the pooled connections to the server."""
        self._http.close()

    # ---- Backend -------------------------------------------------------------------------------

    def generate(
        self,
        prompt: str,
        params: GenParams,
        adapters: AdapterSpec,
        on_text: TextCallback | None = None,
    ) -> GenResult:
        body = {"text": prompt, "sampling_params": params.sglang(), **adapter_fields(adapters)}
        if on_text is None:
            return gen_result(self._post("/generate", body))
        return self._stream(body, on_text)

    def _stream(self, body: dict, on_text: TextCallback) -> GenResult:
        text, last = "", None
        for event in self._events("/generate", {**body, "stream": True}):
            _raise_if_error(event)
            if event["text"].startswith(text):
                on_text(event["text"][len(text) :])
            text, last = event["text"], event
        if last is None:
            raise EndpointError(0, "the stream ended without any event")
        return gen_result(last)

    def score(self, prompt: str, choices: list[str], adapters: AdapterSpec) -> list[list[float]]:
        fields = adapter_fields(adapters)
        head = self._post(
            "/generate", {"text": prompt, "sampling_params": {"max_new_tokens": 0}, **fields}
        )
        start = head["meta_info"]["prompt_tokens"]
        if start == 0:
            raise EndpointError(0, "select needs a non-empty prompt before the choices")
        outs = self._post(
            "/generate",
            {
                "text": [prompt + c for c in choices],
                "sampling_params": {"max_new_tokens": 0},
                "return_logprob": True,
                "logprob_start_len": start,
                **fields,
            },
        )
        return [choice_logprobs(out, start) for out in outs]

    # ---- HTTP ----------------------------------------------------------------------------------

    def _post(self, path: str, body: dict):
        with self._open("POST", path, body) as resp:
            return json.loads(resp.read())

    def _events(self, path: str, body: dict) -> Iterator[dict]:
        with self._open("POST", path, body) as resp:
            for raw in resp.iter_lines():
                line = raw.strip()
                if not line.startswith("data:"):
                    continue
                payload = line[len("data:") :].strip()
                if payload == "[DONE]":
                    return
                yield json.loads(payload)

    @contextmanager
    def _open(self, method: str, path: str, body: dict | None = None) -> Iterator[httpx.Response]:
        """The server's answer to a request, its body not yet read; an error status raises."""
        content = json.dumps(body).encode() if body is not None else None
        with self._http.stream(method, path, content=content) as resp:
            if not resp.is_success:
                raise http_error(resp.status_code, resp.read())
            yield resp


def http_client(base_url: str, api_key: str | None, timeout_s: float) -> httpx.Client:
    """A pooled client for many threads: JSON bodies, the Bearer key, `timeout_s` for connecting
    and for each read or write, redirects followed."""
    headers = {"Content-Type": "application/json"}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    return httpx.Client(
        base_url=base_url,
        headers=headers,
        timeout=timeout_s,
        follow_redirects=True,
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=32),
    )


def adapter_fields(adapters: AdapterSpec) -> dict:
    """The /generate fields naming an adapter set (none for the base model)."""
    if adapters is None:
        return {}
    if isinstance(adapters, str):
        return {"lora_path": adapters}
    return {"adapters": [{"name": name, "weight": weight} for name, weight in adapters]}


def gen_result(out: dict) -> GenResult:
    meta = out.get("meta_info", {})
    finish = meta.get("finish_reason") or {}
    return GenResult(
        text=out["text"],
        finish_reason=finish.get("type"),
        matched_stop=finish.get("matched"),
        prompt_tokens=meta.get("prompt_tokens", 0),
        cached_tokens=meta.get("cached_tokens", 0),
        token_ids=list(out.get("output_ids") or []),
        logprobs=[e[0] for e in meta.get("output_token_logprobs") or []],
    )


def choice_logprobs(out: dict, start: int) -> list[float]:
    """The scored tokens' logprobs of one /generate answer (positions >= start)."""
    meta = out["meta_info"]
    expected = max(meta["prompt_tokens"] - start, 0)
    logprobs = [e[0] for e in meta.get("input_token_logprobs") or [] if e[0] is not None]
    if len(logprobs) != expected:
        raise EndpointError(
            0,
            f"the server returned {len(logprobs)} input_token_logprobs for {expected} scored "
            "tokens: select needs /generate to honour return_logprob with logprob_start_len",
        )
    return logprobs


def http_error(status: int, raw: bytes) -> EndpointError:
    try:
        body = json.loads(raw)
    except ValueError:
        return EndpointError(status, raw.decode(errors="replace")[:500])
    err = body.get("error", body) if isinstance(body, dict) else {}
    if isinstance(err, str):
        return EndpointError(status, err)
    return EndpointError(status, str(err.get("message", body)), err.get("code"))


def _raise_if_error(event: dict) -> None:
    """A failure after the stream started arrives as an error event."""
    if "error" in event:
        raise http_error(0, json.dumps(event).encode())
