"""Chat templates: turn a list of messages into the prompt text an instruct model was trained on.

Renders the Jinja chat template a checkpoint carries (Hugging Face's format: `chat_template` in
tokenizer_config.json, chat_template.jinja, or GGUF's `tokenizer.chat_template`) as transformers'
`apply_chat_template` does, with the special tokens (`bos_token`, `eos_token`, ...) and `tools` /
`documents` (None unless given) as variables, in the bounded sandbox of sandbox.py.

Rendering is all this module does with a conversation: on every turn a Conversation (runtime/chat.py)
renders the whole history with the generation prompt, prompt_ids.py tokenizes that text so that
special-token text inside a message's content stays plain text (only the template's own text becomes
control tokens), and the conversation compares the ids with those its KV cache holds, feeding only the
new ones or rewinding the cache to the common prefix.
"""

from __future__ import annotations

import stat
from pathlib import Path
from typing import Any

from ..errors import ChatTemplateError
from .limits import MAX_DATA_DEPTH, MAX_ENTRIES, MAX_SOURCE_CHARS
from .sandbox import compile_template, render_bounded
from .sizes import PLAIN_TYPES

ROLES = ("system", "user", "assistant", "tool")


def _copied(count: list[int], values: int, where: str) -> None:
    count[0] += values
    if count[0] > MAX_ENTRIES:
        raise ChatTemplateError(f"{where}: more than {MAX_ENTRIES:,} values in the messages and variables")


def _plain(value: Any, where: str, count: list[int] | None = None, depth: int = 0) -> Any:
    """A copy of value made of JSON types only, so a template sees no object with methods of its own.

    count holds how many values were copied so far: a list that holds one list twice is copied twice, so
    data built with shared references could take forever to copy; it is refused past MAX_ENTRIES.
    """
    count = [0] if count is None else count
    _copied(count, 1, where)
    if depth > MAX_DATA_DEPTH:
        raise ChatTemplateError(f"{where}: nested more than {MAX_DATA_DEPTH} levels deep")
    if type(value) in PLAIN_TYPES:
        return value
    if isinstance(value, (list, tuple)):
        if set(map(type, value)) <= PLAIN_TYPES and depth < MAX_DATA_DEPTH:  # the copy in one C call
            _copied(count, len(value), where)
            return list(value) if isinstance(value, list) else tuple(value)
        items = [_plain(item, where, count, depth + 1) for item in value]
        return items if isinstance(value, list) else tuple(items)  # a subclass's methods stay behind
    if isinstance(value, dict):
        for key in value:
            if not isinstance(key, str):
                raise ChatTemplateError(f"{where}: a key {key!r} that is not a string")
        return {str(key): _plain(item, f"{where}, key {key!r}", count, depth + 1) for key, item in value.items()}
    for kind in (str, bool, int, float):  # subclasses such as enums become their base value
        if isinstance(value, kind):
            return kind(value)
    raise ChatTemplateError(
        f"{where}: a {type(value).__name__} value; only str, int, float, bool, None, lists and dicts are allowed"
    )


def validate_messages(messages: Any) -> list[dict]:
    """Check messages and return a plain copy; ChatTemplateError says which message is wrong and why."""
    if not isinstance(messages, list):
        raise ChatTemplateError(f"messages must be a list of dicts, got a {type(messages).__name__}")
    for index, message in enumerate(messages):
        where = f"message {index}"
        if not isinstance(message, dict):
            raise ChatTemplateError(f"{where} is a {type(message).__name__}, not a dict with 'role' and 'content'")
        if "role" not in message:
            raise ChatTemplateError(f"{where} has no 'role' (one of {', '.join(ROLES)})")
        role = message["role"]
        if not isinstance(role, str) or role not in ROLES:
            raise ChatTemplateError(f"{where} has role {role!r}; a role is one of {', '.join(ROLES)}")
        calls_tools = role == "assistant" and bool(message.get("tool_calls"))
        if "content" not in message and not calls_tools:
            raise ChatTemplateError(f"{where} ({role}) has no 'content'")
        content = message.get("content")
        if content is None and not calls_tools:
            raise ChatTemplateError(f"{where} ({role}) has content None; only an assistant message with tool_calls may")
        if content is not None and not isinstance(content, str):
            raise ChatTemplateError(f"{where} ({role}) has content of type {type(content).__name__}, not a string")
    count = [0]
    return [_plain(message, f"message {index}", count) for index, message in enumerate(messages)]


REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")  # transformers' names for a message's reasoning


def _as_transformers_passes(message: dict) -> dict:
    """A message as transformers' apply_chat_template hands it to the template: keys whose value is None dropped
    (an API's `content=None` beside `tool_calls`; templates test whether a key is there, and would print "None"
    or fail on it), and the reasoning under each name templates read (`reasoning_content`, `thinking`)."""
    message = {key: value for key, value in message.items() if value is not None}
    reasoning = next((message[key] for key in REASONING_KEYS if key in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def read_template_file(path: Path) -> str:
    """The text of a chat template file (chat_template.jinja); ChatTemplateError names the file when it is
    not UTF-8 text: a binary file, another encoding, a pipe, one too large to be a template or one it cannot read."""
    try:
        info = path.stat()
        if not stat.S_ISREG(info.st_mode):  # reading a pipe or a device would block or never end
            raise ChatTemplateError(f"{path}: not a regular file, so not a chat template")
        if info.st_size > 4 * MAX_SOURCE_CHARS:  # UTF-8 takes at most 4 bytes a character
            raise ChatTemplateError(f"{path}: {info.st_size:,} bytes is too large for a chat template")
        data = path.read_bytes()
    except OSError as exc:
        raise ChatTemplateError(f"{path}: cannot read the chat template: {exc.strerror or exc}") from exc
    nul = data.find(b"\0")
    if nul >= 0:
        raise ChatTemplateError(f"{path}: a binary file (a NUL byte at offset {nul}), not a chat template")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ChatTemplateError(
            f"{path}: not UTF-8 text (byte {data[exc.start]:#04x} at offset {exc.start}); a chat template is UTF-8"
        ) from exc


class ChatTemplate:
    """A chat template compiled once; render() may be called from several threads at once."""

    def __init__(
        self,
        source: str,
        *,
        bos_token: str | None = None,
        eos_token: str | None = None,
        special: dict[str, str] | None = None,
    ) -> None:
        self.source = source
        self.bos_token = bos_token
        self.eos_token = eos_token
        # What the template sees besides messages, as transformers passes the tokenizer's special tokens.
        tokens = {name: token for name, token in (("bos_token", bos_token), ("eos_token", eos_token)) if token}
        self._special = _plain({**(special or {}), **tokens}, "special tokens")
        self._template, literals = compile_template(source)
        # The template's own text, where its control tokens come from (prompt_ids.py), NUL-separated so that no
        # token text spans two literals: the literals and the special-token strings it is given.
        self.own_text = "\0".join((*literals, *(value for value in self._special.values() if isinstance(value, str))))

    def render(self, messages: list[dict], *, add_generation_prompt: bool = True, **variables: Any) -> str:
        """The prompt text for messages; variables (tools, enable_thinking, date_string, ...) reach the template."""
        context = {
            "tools": None,
            "documents": None,
            **self._special,
            **_plain(variables, "variables"),
            "messages": [_as_transformers_passes(message) for message in validate_messages(messages)],
            "add_generation_prompt": bool(add_generation_prompt),
        }
        return render_bounded(self._template, context)
