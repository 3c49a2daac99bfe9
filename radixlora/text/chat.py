"""Chat templates: the checkpoint's template (chat_template.jinja, or tokenizer_config.json's
`chat_template`), rendered as Hugging Face transformers renders them (`apply_chat_template`): a
sandboxed jinja2 environment with trim_blocks, lstrip_blocks and loop controls, the helpers
`raise_exception` and `strftime_now`, a `tojson` filter that does not escape HTML, and the
tokenizer's special tokens as variables. A checkpoint without one (the tiny demo model) gets
DEFAULT_CHAT_TEMPLATE: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import msgspec
from jinja2 import TemplateError
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radixlora.errors import InvalidRequestError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# tokenizer_config.json entries a template sees as variables (transformers' special tokens)
SPECIAL_TOKENS = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token",
)


def raise_exception(message: str):
    raise TemplateError(message)


def strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    """json.dumps, unescaped (jinja2's own tojson escapes <, >, & and ' for HTML)."""
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


ENV = _environment()


def _token_text(value) -> str | None:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value


# template variables a request's chat_template_kwargs may not set: the request's own, the
# tokenizer's special tokens and the helpers the server gives every template
RESERVED_VARIABLES = frozenset({"messages", "tools", "documents", "add_generation_prompt",
                                "continue_final_message", *SPECIAL_TOKENS, *ENV.globals})


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "",
                 special_tokens: dict[str, str] | None = None):
        """`special_tokens`: more template variables by name (unk_token, pad_token, ...)."""
        self.source = source
        self.template = ENV.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.special_tokens = {
            **(special_tokens or {}), "bos_token": bos_token, "eos_token": eos_token
        }

    @classmethod
    def from_dir(cls, path: str | Path, source: str = "") -> ChatTemplate:
        """The template of a checkpoint directory: `source` when given (--chat-template), else
        its chat_template.jinja (which transformers prefers), else tokenizer_config.json's
        chat_template, else DEFAULT_CHAT_TEMPLATE; the special tokens are the directory's."""
        config = _tokenizer_config(path)
        tokens = {k: _token_text(config.get(k)) for k in SPECIAL_TOKENS}
        tokens = {k: v for k, v in tokens.items() if v is not None}
        return cls(template_sources(path, source)[0], tokens.pop("bos_token", ""),
                   tokens.pop("eos_token", ""), tokens)

    def render(self, messages: list[dict], add_generation_prompt: bool = True,
               tools: list[dict] | None = None, **variables) -> str:
        """The conversation as the model's prompt text; `tools` (JSON schemas) and `variables`
        reach the template as in transformers' apply_chat_template. A template that rejects the
        messages (raise_exception, or a sandbox violation) raises InvalidRequestError."""
        try:
            return self.template.render({
                **self.special_tokens,
                **variables,
                "messages": messages,
                "tools": tools,
                "documents": None,
                "add_generation_prompt": add_generation_prompt,
            })
        except TemplateError as e:
            raise InvalidRequestError(
                f"the chat template rejected the messages: {e}", param="messages"
            ) from e
        except Exception as e:  # noqa: BLE001 - the template is code run on the request's data
            raise InvalidRequestError(
                f"the chat template failed on these messages: {type(e).__name__}: {e}",
                param="messages") from e

    def prompt(self, messages: list[dict], add_generation_prompt: bool | None = None,
               continue_final_message: bool = False,
               template_kwargs: dict | None = None, tools: list[dict] | None = None) -> str:
        """A chat request's prompt, with vLLM's options: `template_kwargs`
        (chat_template_kwargs) are more template variables; continue_final_message renders the
        last message left open, the text cut right after its content (as transformers'
        apply_chat_template does), for the model to continue it. `tools`: the request's tools
        (OpenAI's shape, which Hugging Face templates take). add_generation_prompt None: true
        unless continue_final_message (SGLang's reading; vLLM refuses both true, as here)."""
        kwargs = template_kwargs or {}
        if add_generation_prompt is None:
            add_generation_prompt = not continue_final_message
        reserved = sorted(RESERVED_VARIABLES & kwargs.keys())
        if reserved:
            raise InvalidRequestError(f"chat_template_kwargs may not set {', '.join(reserved)}",
                                      param="chat_template_kwargs")
        if not continue_final_message:
            return self.render(messages, add_generation_prompt, tools, **kwargs)
        if add_generation_prompt:
            raise InvalidRequestError("continue_final_message and add_generation_prompt: true "
                                      "contradict each other: the first continues the last "
                                      "message, the second opens a new one",
                                      param="continue_final_message")
        final = messages[-1]["content"]
        text = self.render(messages, False, tools, **kwargs)
        for probe in (final, final.strip()):
            end = text.rfind(probe) if probe else -1
            if end >= 0:
                return text[:end + len(probe)]
        raise InvalidRequestError("the chat template does not render the last message's "
                                  "content as given, so it cannot be continued",
                                  param="continue_final_message")


def _tokenizer_config(path: str | Path) -> dict:
    file = Path(path) / "tokenizer_config.json"
    return json.loads(file.read_text()) if file.is_file() else {}


def template_sources(path: str | Path, source: str = "") -> list[str]:
    """The chat template ChatTemplate.from_dir renders with, then the directory's other named
    templates (tokenizer_config.json's [{"name": ..., "template": ...}] list: "tool_use"...)."""
    if source:
        return [source]
    jinja = Path(path) / "chat_template.jinja"
    found = jinja.read_text() if jinja.is_file() else _tokenizer_config(path).get("chat_template")
    if isinstance(found, list):
        named = {t.get("name"): t.get("template") for t in found if t.get("template")}
        first = named.get("default") or next(iter(named.values()), None)
        return [first or DEFAULT_CHAT_TEMPLATE, *(t for t in named.values() if t != first)]
    return [found or DEFAULT_CHAT_TEMPLATE]


class ChatMessage(msgspec.Struct, kw_only=True, omit_defaults=True):
    role: str
    content: str
    name: str | None = None  # the participant's name, for templates that show it
    # an assistant message's calls, OpenAI's shape ({"id", "type", "function": {"name",
    # "arguments"}}); a tool message's answer is to tool_call_id
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None

    def as_dict(self) -> dict:
        """The message as the chat template sees it (the optional fields only when given;
        each call's arguments as an object, as Hugging Face templates expect them)."""
        out = {"role": self.role, "content": self.content}
        if self.name is not None:
            out["name"] = self.name
        if self.tool_calls is not None:
            out["tool_calls"] = [_template_call(c) for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        return out


def _template_call(call: dict) -> dict:
    function = dict(call.get("function") or {})
    try:
        arguments = json.loads(function.get("arguments") or "{}")
    except (TypeError, ValueError):
        arguments = None
    if isinstance(arguments, dict):
        function["arguments"] = arguments
    return {**call, "function": function}
