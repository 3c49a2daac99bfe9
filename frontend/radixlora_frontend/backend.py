"""What a program needs from a model: generate text, score choices, and a chat template.

Two backends implement it: `Runtime` (the offline Engine in this process) and `RuntimeEndpoint`
(a `radixlora serve` over HTTP). Both are called from many program threads at once."""

from __future__ import annotations

import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass, field

from radixlora.text.chat import ChatTemplate

from .ir import AdapterSpec, GenParams

TextCallback = Callable[[str], None]


@dataclass
class GenResult:
    """One finished generation. `finish_reason` is "stop" (EOS, a stop token or a stop string,
    named by `matched_stop`), "length" or "abort"."""

    text: str
    finish_reason: str | None
    matched_stop: str | int | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list[float] = field(default_factory=list)

    @property
    def completion_tokens(self) -> int:
        return len(self.token_ids)

    def meta(self) -> dict:
        return {
            "finish_reason": self.finish_reason,
            "matched_stop": self.matched_stop,
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": self.completion_tokens,
            "cached_tokens": self.cached_tokens,
        }


class Backend(ABC):
    @property
    @abstractmethod
    def chat_template(self) -> ChatTemplate:
        """The template that renders `system`/`user`/`assistant` messages."""

    @abstractmethod
    def generate(
        self,
        prompt: str,
        params: GenParams,
        adapters: AdapterSpec,
        on_text: TextCallback | None = None,
    ) -> GenResult:
        """Generate from `prompt` (text) with the adapter set `adapters`; blocks until done.
        `on_text` receives the output text in order, chunk by chunk, as it becomes final."""

    @abstractmethod
    def score(self, prompt: str, choices: list[str], adapters: AdapterSpec) -> list[list[float]]:
        """For each choice, the logprob of each of its tokens: with p = tokenize(prompt) and
        f = tokenize(prompt + choice), the logprobs of f[len(p):], each given all tokens of f
        before it. An empty list when prompt + choice has no more tokens than prompt."""


_default_backend: Backend | None = None
_default_lock = threading.Lock()


def set_default_backend(backend: Backend | None) -> None:
    global _default_backend
    with _default_lock:
        _default_backend = backend


def get_default_backend() -> Backend | None:
    with _default_lock:
        return _default_backend
