"""radixlora: a multi-LoRA LLM serving runtime with an adapter-aware radix prefix cache.

The public names are imported on first use, so `import radixlora` (and `radixlora --version`,
`--help`) load neither torch nor the Triton kernels."""

from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "AdapterError": "radixlora.errors",
    "AdapterNotFoundError": "radixlora.errors",
    "CompletionOutput": "radixlora.engine",
    "Engine": "radixlora.engine",
    "EngineConfig": "radixlora.config",
    "InvalidRequestError": "radixlora.errors",
    "ModelConfig": "radixlora.config",
    "ModelLoadError": "radixlora.errors",
    "RadixLoraError": "radixlora.errors",
    "RequestOutput": "radixlora.engine",
    "SamplingParams": "radixlora.sampling_params",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'radixlora' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

