"""edgelm's runtime: load a model package and generate, with onnxruntime, numpy and tokenizers, and jinja2
for chat templates (runtime/template/).

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
from .results import GenerationResult, Stream, Timings
from .sampling import SamplingParams

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
    "ProviderError",
    "SamplingParams",
    "Stream",
    "Timings",
    "TurnStats",
    "load",
]
