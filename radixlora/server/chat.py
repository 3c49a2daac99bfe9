"""Chat templates: the checkpoint's `chat_template` from tokenizer_config.json, rendered with a
sandboxed jinja2 environment as transformers does. A checkpoint without one (the tiny demo model)
gets DEFAULT_CHAT_TEMPLATE: `<|role|>\\ncontent\\n` per message, then `<|assistant|>\\n`."""

from __future__ import annotations

import json
from pathlib import Path

from jinja2 import TemplateError
from jinja2.sandbox import ImmutableSandboxedEnvironment

from radixlora.errors import InvalidRequestError

DEFAULT_CHAT_TEMPLATE = (
    "{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def _raise(message: str):
    raise TemplateError(message)


def _token_text(value) -> str:
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value or ""


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = ""):
        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = _raise
        self.source = source
        self.template = env.from_string(source)
        self.bos_token = bos_token
        self.eos_token = eos_token

    @classmethod
    def from_dir(cls, path: str | Path) -> ChatTemplate:
        file = Path(path) / "tokenizer_config.json"
        config = json.loads(file.read_text()) if file.is_file() else {}
        source = config.get("chat_template") or DEFAULT_CHAT_TEMPLATE
        if isinstance(source, list):  # named templates: [{"name": ..., "template": ...}]
            named = {t.get("name"): t.get("template") for t in source}
            source = named.get("default") or next(iter(named.values()))
        return cls(
            source, _token_text(config.get("bos_token")), _token_text(config.get("eos_token"))
        )

    def render(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        try:
            return self.template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                bos_token=self.bos_token,
                eos_token=self.eos_token,
            )
        except TemplateError as e:
            raise InvalidRequestError(
                f"the chat template rejected the messages: {e}", param="messages"
            ) from e
