"""OpenAI's request and response shapes for chat completions and completions, as the server speaks them.

Requests are pydantic models validated at the edge (field names as OpenAI's API reference writes them); a
field OpenAI defines that this server cannot honour (n > 1, logprobs, logit_bias, penalties) is refused with a
400 naming it rather than ignored, and a field no one defines is ignored, as OpenAI-compatible servers do
(clients send vendor extras). llama.cpp's extras `top_k`, `min_p` and `repetition_penalty` are accepted.
Responses are plain dicts built by the functions below (ids `chatcmpl-...` / `cmpl-...`, `object`, `created`,
`choices`, `usage`), streamed chunks included (`chat.completion.chunk`, `text_completion`).
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from edgelm.runtime import untrusted

from .errors import APIError

FINISH_REASONS = {"eos": "stop", "stop": "stop", "length": "length", "cancelled": "stop"}


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    include_usage: bool | None = None


class Request(BaseModel):
    """What chat completions and completions share. Strict: a value of the wrong JSON type is refused (`true` or
    `"5"` for max_tokens, `"yes"` for stream), never coerced; null is accepted wherever OpenAI's API accepts it."""

    model_config = ConfigDict(extra="ignore", strict=True)

    model: str
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    max_tokens: int | None = Field(default=None, ge=0)
    temperature: float | None = Field(default=None, ge=0)
    top_p: float | None = None
    seed: int | None = Field(default=None, ge=0)
    stop: str | list[str] | None = None
    n: int | None = None
    logprobs: bool | int | None = None
    logit_bias: dict[str, float] | None = None
    frequency_penalty: float | None = None
    presence_penalty: float | None = None
    user: str | None = None
    # llama.cpp's extras (openai clients send them with extra_body)
    top_k: int | None = Field(default=None, ge=0)
    min_p: float | None = None
    repetition_penalty: float | None = None

    def refuse_unsupported(self) -> None:
        """APIError (400, naming the field) for a field set to a value this server cannot honour."""
        if self.n not in (None, 1):
            raise APIError(400, "n must be 1: this server generates one choice per request", param="n")
        if self.logprobs not in (None, False, 0):
            raise APIError(400, "logprobs are not supported by this server", param="logprobs")
        if self.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
        for name in ("frequency_penalty", "presence_penalty"):
            if getattr(self, name) not in (None, 0):
                raise APIError(
                    400, f"{name} is not supported; use repetition_penalty (> 1 discourages repeats)", param=name
                )

    def sampling(self) -> dict[str, Any]:
        """The generation options of the runtime (Model.generate's keywords) this request sets; OpenAI's defaults
        (temperature 1, top_p 1) where it sets none."""
        options = {"temperature": 1.0 if self.temperature is None else self.temperature}
        for name in ("top_p", "seed", "stop", "top_k", "min_p", "repetition_penalty"):
            if getattr(self, name) is not None:
                options[name] = getattr(self, name)
        return options

    @property
    def streamed(self) -> bool:
        return bool(self.stream)  # null: not streamed, as OpenAI reads it

    @property
    def include_usage(self) -> bool:
        return bool(self.stream and self.stream_options and self.stream_options.include_usage)


class FunctionSpec(BaseModel):
    """A tool's function, as OpenAI's `tools` entries hold it; other keys go on to the template as given."""

    model_config = ConfigDict(extra="allow", strict=True)

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None


class ToolSpec(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    type: Literal["function"]
    function: FunctionSpec


class CalledFunction(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)

    name: str
    arguments: str | dict[str, Any]  # OpenAI sends JSON text; an object is what templates read


class MessageToolCall(BaseModel):
    """An assistant message's tool call, as OpenAI's API sends it back."""

    model_config = ConfigDict(extra="allow", strict=True)

    id: str | None = None
    type: Literal["function"] | None = None
    function: CalledFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True)  # other keys are passed on to the template

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None

    def plain(self, index: int) -> dict:
        """The message as the runtime takes it: a text part list joined, `developer` as `system`."""
        message = self.model_dump(exclude_none=True)
        message["role"] = "system" if self.role == "developer" else self.role
        if isinstance(self.content, list):
            texts = []
            for part in self.content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise APIError(
                        400, f"messages[{index}]: only text content parts are supported", param=f"messages[{index}]"
                    )
                texts.append(part["text"])
            message["content"] = "".join(texts)
        for number, call in enumerate(message.get("tool_calls") or []):
            function = call["function"]
            if isinstance(function["arguments"], str):
                try:  # OpenAI sends arguments as JSON text; templates read them as an object (transformers' way)
                    function["arguments"] = untrusted.loads(function["arguments"])
                except untrusted.Unbounded as e:
                    where = f"messages[{index}].tool_calls[{number}].function.arguments"
                    raise APIError(400, f"{where} is not valid JSON ({e})", param=where) from None
        return message


class ChatCompletionRequest(Request):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=0)
    # tools, template variables and structured output: passed to the runtime by api_extras (edgelm/serve/app.py)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    response_format: dict[str, Any] | None = None
    reasoning_effort: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # vLLM's and llama.cpp's extra: template variables

    @property
    def tool_specs(self) -> list[dict] | None:
        """The tools as the client sent them (the keys it set, extras included), for the template."""
        return None if self.tools is None else [tool.model_dump(exclude_unset=True) for tool in self.tools]

    @property
    def reply_tokens(self) -> int | None:
        """max_completion_tokens, else the older max_tokens; None: the rest of the context."""
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


class CompletionRequest(Request):
    prompt: str | list[str] | list[int] | list[list[int]]
    echo: bool | None = None
    suffix: str | None = None
    best_of: int | None = None

    def refuse_unsupported(self) -> None:
        super().refuse_unsupported()
        if self.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if self.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        if self.best_of not in (None, 1):
            raise APIError(400, "best_of must be 1", param="best_of")

    def single_prompt(self) -> str | list[int]:
        """The one prompt: text or token ids. Several prompts in one request: APIError."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            if len(prompt) != 1:
                raise APIError(400, "this server takes one prompt per request", param="prompt")
            prompt = prompt[0]
        return prompt


# ---- responses -------------------------------------------------------------------------------------


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(result, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object from a GenerationResult; cached_tokens: prompt tokens the prompt cache held. The EOS
    token that ended a reply was generated, so it counts as a completion token (as OpenAI and vLLM count it),
    though the result's token_ids leave it out."""
    prompt = len(result.prompt_token_ids)
    completion = len(result.token_ids) + (result.finish_reason == "eos")
    counts = {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
    if cached_tokens is not None:
        counts["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return counts


def finish_reason(result) -> str:
    if getattr(result, "tool_calls", None):
        return "tool_calls"
    return FINISH_REASONS.get(result.finish_reason, "stop")


def assistant_message(result) -> dict:
    """The reply as OpenAI's message: its content, and the tool calls and reasoning the runtime parsed out of it
    where it does (docs/apps.md: result.content, .reasoning, .tool_calls; before that, the text is the content)."""
    message: dict[str, Any] = {"role": "assistant", "content": getattr(result, "content", result.text)}
    tool_calls = getattr(result, "tool_calls", None)
    if tool_calls:
        message["tool_calls"] = [openai_tool_call(call) for call in tool_calls]
        message["content"] = message["content"] or None
    reasoning = getattr(result, "reasoning", None)
    if reasoning:
        message["reasoning_content"] = reasoning  # the field llama.cpp's and vLLM's servers use
    return message


def openai_tool_call(call: Any) -> dict:
    """A runtime ToolCall as OpenAI's tool_calls entry: {"id", "type": "function", "function": {"name",
    "arguments": JSON text}}."""
    if hasattr(call, "to_openai"):
        return call.to_openai()
    return {
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": json.dumps(call.arguments, ensure_ascii=False)},
    }


def chat_delta(piece: str, calls_before: int) -> dict:
    """A streamed piece as a chunk's delta: its content, reasoning and the tool calls it completed (each whole,
    numbered from calls_before); plain text pieces (a runtime that parses nothing) are content."""
    delta: dict[str, Any] = {}
    content = getattr(piece, "content", piece)
    if content:
        delta["content"] = content
    reasoning = getattr(piece, "reasoning", None)
    if reasoning:
        delta["reasoning_content"] = reasoning
    calls = getattr(piece, "tool_calls", None)
    if calls:
        delta["tool_calls"] = [{"index": calls_before + i, **openai_tool_call(call)} for i, call in enumerate(calls)]
    return delta


def chat_completion(request_id: str, model: str, result, cached_tokens: int | None) -> dict:
    return {
        "id": request_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [
            {"index": 0, "message": assistant_message(result), "finish_reason": finish_reason(result), "logprobs": None}
        ],
        "usage": usage(result, cached_tokens),
    }


def chat_chunk(request_id: str, model: str, delta: dict | None, finish: str | None = None, *, usage_=None) -> dict:
    """One `chat.completion.chunk`: a delta, or the finish reason, or (choices empty) the usage."""
    chunk: dict[str, Any] = {
        "id": request_id,
        "object": "chat.completion.chunk",
        "created": int(time.time()),
        "model": model,
    }
    chunk["choices"] = (
        [] if delta is None else [{"index": 0, "delta": delta, "finish_reason": finish, "logprobs": None}]
    )
    if usage_ is not None:
        chunk["usage"] = usage_
    return chunk


def text_completion(request_id: str, model: str, text: str, finish: str | None, *, usage_=None) -> dict:
    """A `text_completion` object, or one chunk of a streamed one (the same shape)."""
    body: dict[str, Any] = {
        "id": request_id,
        "object": "text_completion",
        "created": int(time.time()),
        "model": model,
        "choices": [{"index": 0, "text": text, "finish_reason": finish, "logprobs": None}],
    }
    if usage_ is not None:
        body["usage"] = usage_
    return body
