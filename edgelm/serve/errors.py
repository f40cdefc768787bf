"""OpenAI's error objects: `{"error": {"message", "type", "param", "code"}}` with the HTTP status a client expects,
and the mapping from the runtime's documented exceptions (runtime/errors.py) to them."""

from __future__ import annotations

from edgelm.runtime import (
    AdapterError,
    ChatTemplateError,
    ContextLengthError,
    EdgelmError,
    InvalidInputError,
    InvalidParameterError,
)


class APIError(Exception):
    """An error answered as OpenAI's error object with `status`."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None, kind=None):
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.kind = kind or ("invalid_request_error" if 400 <= status < 500 else "server_error")

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def from_runtime(error: Exception, *, prompt_param: str | None) -> APIError:
    """The APIError for an exception the runtime raised while taking or running a request; prompt_param: the
    request field holding the prompt ("messages" or "prompt"), None where it is not known."""
    if isinstance(error, APIError):  # the server's own (a shutdown)
        return error
    message = " ".join(str(error).split()) or type(error).__name__
    if isinstance(error, ContextLengthError):
        return APIError(400, message, param=prompt_param, code="context_length_exceeded")
    if isinstance(error, ChatTemplateError):
        return APIError(400, message, param=prompt_param, code="invalid_messages")
    if isinstance(error, (InvalidParameterError, AdapterError)):
        return APIError(400, message, code="invalid_value")
    if isinstance(error, InvalidInputError):
        return APIError(400, message, param=prompt_param, code="invalid_value")
    if isinstance(error, TypeError):  # an option the runtime does not take (a build without tools, say)
        return APIError(400, message, code="unsupported_parameter")
    if isinstance(error, EdgelmError):  # PackageError: the package failed while running
        return APIError(500, message, code="model_error")
    return APIError(500, f"internal error: {type(error).__name__}: {message}")
