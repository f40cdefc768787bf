"""The exceptions the runtime raises for bad input. All derive from EdgelmError, and from the
built-in type a caller would expect (ValueError, FileNotFoundError), so either can be caught."""

from __future__ import annotations


class EdgelmError(Exception):
    """Base class of every error edgelm raises on purpose."""


class PackageError(EdgelmError, ValueError):
    """A model package that is incomplete, corrupt, tampered with or of an unknown kind."""


class PackageNotFoundError(PackageError, FileNotFoundError):
    """The package folder, or a file it must hold, does not exist."""


class InvalidParameterError(EdgelmError, ValueError):
    """A generation parameter outside its valid range (temperature < 0, top_p outside (0, 1], ...)."""


class InvalidInputError(EdgelmError, ValueError):
    """A prompt the model cannot take: empty, token ids outside the vocabulary, not text."""


class ContextLengthError(InvalidInputError):
    """Prompt plus new tokens would exceed the model's context length."""


class ProviderError(EdgelmError, ValueError):
    """An execution provider that is unknown or not installed."""


class ChatTemplateError(EdgelmError, ValueError):
    """A chat template that does not compile or fails to render, or messages it cannot take."""


class AdapterError(EdgelmError, ValueError):
    """A LoRA adapter that cannot be used: unreadable, tampered, for another base, or not fitting its slots."""


def non_finite_logits() -> PackageError:
    """The error for logits holding NaN or inf where a token is picked (plain and speculative decoding alike)."""
    return PackageError("the model produced non-finite logits (a broken or badly quantized package)")
