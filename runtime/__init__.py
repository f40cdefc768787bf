"""edgelm's runtime: load a model package and generate, with onnxruntime, numpy and tokenizers only; chat adds
jinja2 (its templates), imported when chat is first used (Model.chat/conversation, or Conversation from here).

Imports nothing from export/ or quantize/ and never torch, so an application can ship this folder
alone (its imports are all relative).
"""

from typing import Any

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


def __getattr__(name: str) -> Any:
    """Conversation and TurnStats (runtime/chat.py) load the chat template machinery, and jinja2, when asked for."""
    if name in ("Conversation", "TurnStats"):
        from . import chat

        return getattr(chat, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


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
