"""radixlora: a multi-LoRA LLM serving runtime with an adapter-aware radix prefix cache."""

from radixlora.config import EngineConfig, ModelConfig
from radixlora.engine import CompletionOutput, Engine, RequestOutput
from radixlora.errors import (
    AdapterError,
    AdapterNotFoundError,
    InvalidRequestError,
    ModelLoadError,
    RadixLoraError,
)
from radixlora.sampling import SamplingParams

__all__ = [
    "AdapterError",
    "AdapterNotFoundError",
    "CompletionOutput",
    "Engine",
    "EngineConfig",
    "InvalidRequestError",
    "ModelConfig",
    "ModelLoadError",
    "RadixLoraError",
    "RequestOutput",
    "SamplingParams",
]
