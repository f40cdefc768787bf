"""edgelm's runtime: load a model package and generate, with onnxruntime, numpy and tokenizers only.

Imports nothing from export/ or quantize/ and never torch, so an application can ship this folder
alone (its imports are all relative).
"""

from .chat import Conversation, TurnStats
from .errors import (
    AdapterError,
    ChatTemplateError,
    ContextLengthError,
    EdgelmError,
    InvalidInputError,
    InvalidParameterError,
    PackageError,
    PackageNotFoundError,
    ProviderError,
)
from .model import Model, load
from .results import GenerationResult, Piece, Stream, Timings
from .sampling import SamplingParams
from .tool_calls import ToolCall
from .tools import tool_schema

__all__ = [
    "AdapterError",
    "ChatTemplateError",
    "ContextLengthError",
    "Conversation",
    "EdgelmError",
    "GenerationResult",
    "InvalidInputError",
    "InvalidParameterError",
    "Model",
    "PackageError",
    "PackageNotFoundError",
    "Piece",
    "ProviderError",
    "SamplingParams",
    "Stream",
    "Timings",
    "ToolCall",
    "TurnStats",
    "load",
    "tool_schema",
]
