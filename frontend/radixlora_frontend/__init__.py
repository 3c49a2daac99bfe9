"""radixlora's frontend language: programs whose every generation call picks its adapters.

    from radixlora_frontend import Runtime, function, gen, select, set_default_backend

    @function
    def triage(s, ticket):
        s += "Ticket: " + ticket + "\\nCategory: "
        s += select("category", choices=["billing", "legal", "other"])
        with s.adapter("legal" if s["category"] == "legal" else "support"):
            s += "\\nAnswer: " + gen("answer", max_tokens=64, stop="\\n")

    set_default_backend(Runtime("path/to/model", adapters={"legal": ..., "support": ...}))
    state = triage.run(ticket="...")

See docs/frontend.md."""

from radixlora_frontend.backend import (
    Backend,
    GenResult,
    get_default_backend,
    set_default_backend,
)
from radixlora_frontend.endpoint import EndpointError, RuntimeEndpoint
from radixlora_frontend.interpreter import ForkGroup, ProgramState
from radixlora_frontend.ir import GenParams, assistant, gen, select, system, user
from radixlora_frontend.program import Program, function
from radixlora_frontend.runtime import Runtime

__all__ = [
    "Backend",
    "EndpointError",
    "ForkGroup",
    "GenParams",
    "GenResult",
    "Program",
    "ProgramState",
    "Runtime",
    "RuntimeEndpoint",
    "assistant",
    "function",
    "gen",
    "get_default_backend",
    "select",
    "set_default_backend",
    "system",
    "user",
]
