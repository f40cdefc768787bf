"""A chat turn's inputs, checked before anything changes: the variables a template renders with (tools,
documents, enable_thinking, any others) and the messages send/stream add to the history (runtime/chat.py)."""

from __future__ import annotations

from typing import Any

from .errors import ChatTemplateError, InvalidInputError
from .template import validate_messages
from .tools import tool_specs

TURN_VARIABLES = ("tools", "documents", "enable_thinking", "template_vars")


def template_variables(
    tools: Any = None, documents: Any = None, enable_thinking: Any = None, template_vars: Any = None
) -> dict:
    """The variables a template renders with, checked: tools (functions described: runtime/tools.py), documents,
    enable_thinking (None: not passed) and any others in template_vars. ChatTemplateError for bad ones."""
    if template_vars is not None and not isinstance(template_vars, dict):
        raise ChatTemplateError(f"template_vars must be a dict, got {type(template_vars).__name__}")
    variables = dict(template_vars or {})
    for name in variables:
        if not isinstance(name, str):  # a template variable is a name
            raise ChatTemplateError(f"template_vars keys must be strings, got {name!r:.60}")
    for name in ("messages", "add_generation_prompt"):
        if name in variables:
            raise ChatTemplateError(f"template_vars may not set {name!r}: it is the chat's own")
    if tools is not None:
        variables["tools"] = tool_specs(tools)
    if documents is not None:
        if not isinstance(documents, (list, tuple)) or not all(isinstance(d, dict) for d in documents):
            raise ChatTemplateError("documents must be a list of dicts (e.g. {'title': ..., 'text': ...})")
        variables["documents"] = list(documents)
    if enable_thinking is not None:
        if not isinstance(enable_thinking, bool):
            raise ChatTemplateError(f"enable_thinking must be True, False or None, got {enable_thinking!r}")
        variables["enable_thinking"] = enable_thinking
    return variables


def new_messages(message: Any) -> list[dict]:
    """What send/stream add to the history: a user message's text, a message dict, or a list of them."""
    if isinstance(message, str):
        return [{"role": "user", "content": message}]
    if isinstance(message, dict):
        message = [message]
    if not isinstance(message, list) or not message:
        raise InvalidInputError(f"a message must be a string, a message dict or a list of them, got {message!r:.60}")
    for item in message:
        if isinstance(item, dict) and item.get("role") == "system":
            raise InvalidInputError("a system message goes first: pass system= to conversation(), or use reply_to")
    return validate_messages(message)
