"""Typed errors. Every user-facing failure is one of these, never a bare exception."""

from __future__ import annotations


class RadixLoraError(Exception):
    """Base class of every error the runtime raises on purpose."""


class AdapterError(RadixLoraError):
    """An adapter could not be loaded or used; names the adapter and the reason."""

    def __init__(self, name: str, reason: str, code: str = "invalid_adapter"):
        super().__init__(f"adapter {name!r}: {reason}")
        self.name = name
        self.reason = reason
        self.code = code


class AdapterNotFoundError(AdapterError):
    def __init__(self, name: str):
        super().__init__(name, "not loaded", code="adapter_not_found")


class InvalidRequestError(RadixLoraError):
    """A request is malformed or can never be served; `param` names the offending field."""

    def __init__(self, message: str, param: str | None = None, code: str = "invalid_request"):
        super().__init__(message)
        self.message = message
        self.param = param
        self.code = code


class ModelLoadError(RadixLoraError):
    """The base model directory is missing, malformed or of an unsupported architecture."""


class SizingError(RadixLoraError):
    """The device has too little memory for what the sizing flags ask."""
