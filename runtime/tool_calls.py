"""A chat reply parsed into content, reasoning and tool calls, by the conventions of the families' templates.

One table, CONVENTIONS: each row names the text a chat template writes that selects it (its marker), and
how a reply written that way splits into reasoning, content and tool calls:

- hermes: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Qwen2.5, Qwen3, Hermes 2/3, SmolLM3)
- mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` to the end (Mistral v3, Nemo, Small)
- phi4: `<|tool_call|>[{"name": ..., "arguments": {...}}]<|/tool_call|>` (Phi-4-mini)
- harmony: gpt-oss channels, `<|channel|>analysis<|message|>...<|end|>` reasoning, `<|channel|>final` content,
  `to=functions.NAME ... <|message|>{...}` a call (OpenAI's harmony format)
- tool_code: Gemma's ```` ```tool_code\\nname(a=1, b="x")\\n``` ```` Python calls
- llama3: the whole reply one JSON object `{"name": ..., "parameters": {...}}`, maybe after `<|python_tag|>`,
  several separated by ';' (Llama 3.1, 3.2, 3.3)

Reasoning between `<think>` and `</think>` (Qwen3, SmolLM3, DeepSeek-R1, QwQ) is separated in every row whose
template writes `<think>`; a generation prompt that ends inside an open `<think>` starts the reply in it.

The convention is read from the chat template's text once (`convention_for`): the template is the package's
record of how its model writes calls, so nothing is guessed from a family name and packages exported before
this existed, `template=` overrides and GGUF templates all work. `parse(text, final)` is pure; streaming
parses the text so far with final=False, which holds back whatever could still turn out to be markup (an
unclosed call, a tail that may begin a marker, whitespace before a possible call), so successive parses only
grow and their differences are the stream's deltas.
"""

from __future__ import annotations

import ast
import json
import re
import secrets
import string
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from . import untrusted

THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


@dataclass
class ToolCall:
    """One call the model asked for: its id, the function's name and its arguments (a JSON object)."""

    id: str
    name: str
    arguments: dict

    def to_message(self) -> dict:
        """The call as a chat template reads it in an assistant message's tool_calls (arguments a dict)."""
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}

    def to_openai(self) -> dict:
        """The call as OpenAI's API returns it (arguments as strict JSON text: the parsers never let NaN or
        Infinity in, and allow_nan=False holds that)."""
        arguments = json.dumps(self.arguments, ensure_ascii=False, allow_nan=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


@dataclass
class Parsed:
    """A reply split up: content, reasoning (None when there is none) and calls as (name, arguments)."""

    content: str = ""
    reasoning: str | None = None
    calls: list[tuple[str, dict]] = field(default_factory=list)
    kept: str = ""  # the reply with the calls' markup cut out (reasoning left in): the history's content


# ---- call bodies --------------------------------------------------------------------------------------------


def _json_calls(body: str, arguments_key: str = "arguments") -> list[tuple[str, dict]] | None:
    """{"name", "arguments"} objects, one or a JSON list of them; None when body is not that (or not strict,
    bounded JSON: runtime/untrusted.py)."""
    try:
        value = untrusted.loads(body)
    except untrusted.Unbounded:
        return None
    items = value if isinstance(value, list) else [value]
    calls = []
    for item in items:
        if not isinstance(item, dict) or not isinstance(item.get("name"), str):
            return None
        arguments = item.get(arguments_key, item.get("arguments", item.get("parameters", {})))
        if isinstance(arguments, str):  # some models write the arguments as JSON text
            try:
                arguments = untrusted.loads(arguments)
            except untrusted.Unbounded:
                return None
        if not isinstance(arguments, dict):
            return None
        calls.append((item["name"], arguments))
    return calls or None


def _python_calls(body: str) -> list[tuple[str, dict]] | None:
    """`name(a=1, b="x")` calls, one per line or statement, keyword arguments of JSON's literal values only
    (str, int, float, bool, None, lists, tuples as lists, dicts with str keys); None for anything else."""
    body = body.strip()
    if len(body) > untrusted.MAX_CALL_CHARS or untrusted.depth_of(body) > untrusted.MAX_DEPTH:
        return None
    try:
        tree = ast.parse(body)
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # MemoryError: the parser's "too complex"
        return None
    calls = []
    for statement in tree.body:
        call = statement.value if isinstance(statement, ast.Expr) else None
        if not isinstance(call, ast.Call) or call.args:
            return None
        name = _dotted_name(call.func)
        if name is None:
            return None
        if name.endswith(".call"):  # Llama 3.1's built-in tools: brave_search.call(query="...")
            name = name[: -len(".call")]
        arguments = {}
        for keyword in call.keywords:
            if keyword.arg is None:  # **kwargs
                return None
            try:
                arguments[keyword.arg] = _literal(keyword.value)
            except untrusted.Unbounded:
                return None
        calls.append((name, arguments))
    return calls or None


MAX_NAME_PARTS = 8  # a dotted function name: brave_search.call, a.b.c


def _dotted_name(node: ast.expr) -> str | None:
    """`a.b.c` as text, walked without recursion; None for anything but a short chain of names."""
    parts = []
    while isinstance(node, ast.Attribute) and len(parts) < MAX_NAME_PARTS:
        parts.append(node.attr)
        node = node.value
    if not isinstance(node, ast.Name):
        return None
    return ".".join([node.id, *reversed(parts)])


def _literal(node: ast.expr, depth: int = 0) -> Any:
    """A Python literal as the JSON value it writes (tuples as lists); Unbounded for anything JSON has no word
    for (sets, bytes, complex numbers, Ellipsis, non-str keys, expressions) or past runtime/untrusted.py's bounds."""
    if depth > untrusted.MAX_DEPTH:
        raise untrusted.Unbounded(f"nested more than {untrusted.MAX_DEPTH} deep")
    if isinstance(node, ast.Constant):
        value = node.value
        if value is None or isinstance(value, (bool, str)):
            return value
        if isinstance(value, (int, float)):
            untrusted.check(value)
            return value
        raise untrusted.Unbounded(f"{type(value).__name__} is not a JSON value")
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, (ast.USub, ast.UAdd)):
        operand = node.operand  # one sign on a number: -1, +2.5
        if isinstance(operand, ast.Constant) and type(operand.value) in (int, float):
            untrusted.check(operand.value)
            return -operand.value if isinstance(node.op, ast.USub) else operand.value
        raise untrusted.Unbounded("a sign on something other than a number")
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item, depth + 1) for item in node.elts]
    if isinstance(node, ast.Dict):
        result = {}
        for key, value in zip(node.keys, node.values, strict=True):
            if not (isinstance(key, ast.Constant) and isinstance(key.value, str)):
                raise untrusted.Unbounded("a dict key that is not a string")
            result[key.value] = _literal(value, depth + 1)
        return result
    raise untrusted.Unbounded(f"{type(node).__name__} is not a literal")


def _llama3_calls(body: str) -> list[tuple[str, dict]] | None:
    """JSON {"name", "parameters"} objects separated by ';', or a built-in tool's Python call."""
    parts = [part for part in body.split(";") if part.strip()]
    calls = []
    for part in parts:
        found = _json_calls(part, "parameters")
        if found is None:
            return _python_calls(body) if body.strip() else None
        calls += found
    return calls or None


# ---- the table ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Convention:
    """How one family's replies are written. Calls are blocks from `open` to `close` ("" = to the end of the
    reply) whose body `calls` parses; with `open` "" the whole reply is one block (llama3)."""

    name: str
    marker: str  # text in the chat template's source that selects this row
    open: str
    close: str
    calls: Callable[[str], list[tuple[str, dict]] | None]
    ids: str = "call"  # how call ids look: "call" (call_ + hex) or "alnum9" (Mistral's 9 characters)
    think: bool = False  # <think> reasoning: set by convention_for when the template writes <think>

    def markers(self) -> list[str]:
        """The markup strings a reply may contain (a tokenizer may hold them as special tokens)."""
        found = [text for text in (self.open, self.close) if text]
        if self.name == "llama3":
            found.append("<|python_tag|>")
        if self.name == "harmony":
            found += ["<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|constrain|>"]
        return found + ([THINK_OPEN, THINK_CLOSE] if self.think else [])

    def new_id(self) -> str:
        if self.ids == "alnum9":
            alphabet = string.ascii_letters + string.digits
            return "".join(secrets.choice(alphabet) for _ in range(9))
        return f"call_{secrets.token_hex(12)}"

    def parse(self, text: str, *, final: bool, in_reasoning: bool = False) -> Parsed:
        if self.name == "harmony":
            return _parse_harmony(text, final)
        reasoning, rest, offset = None, text, 0
        if self.think:
            reasoning, rest, offset = _split_think(text, final, in_reasoning)
            if reasoning is not None and rest is None:  # still thinking
                return Parsed("", reasoning, [], text)
        assert rest is not None
        parsed = self._parse_calls(rest, final)
        parsed.reasoning = reasoning
        if reasoning is not None:
            parsed.content = parsed.content.lstrip()
            parsed.kept = text[:offset] + parsed.kept
        return parsed

    def _parse_calls(self, text: str, final: bool) -> Parsed:
        if self.name == "plain":  # no calls: the text is the content
            return Parsed(text, None, [], text)
        if not self.open:  # llama3: the whole reply is a call or it is content
            return _parse_whole(text, final, self.calls)
        content, kept, calls, position = [], [], [], 0
        while True:
            start = text.find(self.open, position)
            if start < 0:
                tail = text[position:]
                if not final:  # hold back what may still begin a call, and whitespace before one
                    tail = _hold(tail, [self.open])
                content.append(tail)
                kept.append(tail)
                break
            before = text[position:start]
            end = text.find(self.close, start + len(self.open)) if self.close else -1
            if end < 0 and not (final or not self.close):
                content.append(before.rstrip())
                kept.append(before.rstrip())
                break  # an unclosed call: wait for its end
            stop = end if end >= 0 else len(text)
            if not self.close and not final:
                content.append(before.rstrip())
                kept.append(before.rstrip())
                break  # a call that runs to the end of the reply: parsed when the reply ends
            body = text[start + len(self.open) : stop]
            found = self.calls(body)
            block_end = stop + len(self.close) if end >= 0 else len(text)
            if found is None:  # not a call after all: the block stays text
                content.append(text[position:block_end])
                kept.append(text[position:block_end])
            else:
                content.append(before.rstrip())
                kept.append(before)
                calls += found
            position = block_end
            if position < len(text) and found is not None:
                rest = text[position:]
                skipped = len(rest) - len(rest.lstrip())
                kept.append(rest[:skipped])
                position += skipped
        joined = "".join(piece for piece in content)
        return Parsed(joined, None, calls, "".join(kept))


def _hold(tail: str, markers: list[str]) -> str:
    """tail without an ending that could begin one of markers, and without trailing whitespace."""
    cut = len(tail)
    for marker in markers:
        for size in range(min(len(marker) - 1, len(tail)), 0, -1):
            if tail.endswith(marker[:size]):
                cut = min(cut, len(tail) - size)
                break
    return tail[:cut].rstrip()


def _split_think(text: str, final: bool, in_reasoning: bool) -> tuple[str | None, str | None, int]:
    """(reasoning, the rest, where the rest starts) of a reply that may open with <think>; rest None while the
    reasoning is unfinished; reasoning None when there is none."""
    stripped = text.lstrip()
    if not in_reasoning:
        if not stripped.startswith(THINK_OPEN):
            if not final and THINK_OPEN.startswith(stripped):  # "<thi": wait
                return "", None, 0
            return None, text, 0
        start = len(text) - len(stripped) + len(THINK_OPEN)
    else:
        start = 0
    end = text.find(THINK_CLOSE, start)
    if end < 0:
        if final:
            return text[start:].strip(), "", len(text)
        return _hold(text[start:], [THINK_CLOSE]).strip(), None, 0
    return text[start:end].strip(), text[end + len(THINK_CLOSE) :], end + len(THINK_CLOSE)


def _parse_whole(text: str, final: bool, calls: Callable) -> Parsed:
    """llama3: a reply that starts with '{' or <|python_tag|> may be calls; known only at its end."""
    body = text.strip()
    tagged = body.startswith("<|python_tag|>")
    maybe = tagged or body.startswith("{") or "<|python_tag|>".startswith(body)
    if not final:
        return Parsed("", None, [], "") if maybe else Parsed(text.rstrip(), None, [], text.rstrip())
    found = calls(body[len("<|python_tag|>") :] if tagged else body) if maybe and body else None
    if found is None:
        return Parsed(text, None, [], text)
    return Parsed("", None, found, "")


HARMONY_SEGMENT = re.compile(r"(?:<\|start\|>)?(?P<header>[^<]*(?:<\|(?!message\|>)[a-z]+\|>[^<]*)*)<\|message\|>")


def _parse_harmony(text: str, final: bool) -> Parsed:
    """gpt-oss: messages `header<|message|>body<|end|>` (the last may end the reply); a header names its channel
    (<|channel|>analysis / commentary / final) and a call's recipient (to=functions.NAME)."""
    reasoning, content, calls, position = [], [], [], 0
    while True:
        match = HARMONY_SEGMENT.match(text, position)
        if match is None:
            break
        header = match.group("header")
        end = text.find("<|end|>", match.end())
        closed = end >= 0
        body = text[match.end() : end if closed else len(text)]
        channel = re.search(r"<\|channel\|>\s*(\w+)", header)
        recipient = re.search(r"to=functions\.([\w.\-]+)", header)
        if recipient:
            if not (closed or final):
                break
            arguments = _loads(body)
            if isinstance(arguments, dict):
                calls.append((recipient.group(1), arguments))
        elif channel and channel.group(1) == "analysis":
            reasoning.append(body if (closed or final) else _hold(body, ["<|end|>"]))
        else:
            content.append(body if (closed or final) else _hold(body, ["<|end|>"]))
        if not closed:
            break
        position = end + len("<|end|>")
    if position == 0 and not reasoning and not content and not calls and final and "<|message|>" not in text:
        return Parsed(text, None, [], text)  # no harmony markup at all
    joined = "".join(content)
    thinking = "".join(reasoning) if reasoning else None
    return Parsed(joined, thinking, calls, joined)


def _loads(body: str) -> Any:
    """body as strict, bounded JSON (runtime/untrusted.py); None when it is not."""
    try:
        return untrusted.loads(body)
    except untrusted.Unbounded:
        return None


CONVENTIONS = (
    Convention("harmony", "<|channel|>", "", "", _json_calls),
    Convention("mistral", "[TOOL_CALLS]", "[TOOL_CALLS]", "", _json_calls, ids="alnum9"),
    Convention("phi4", "<|tool_call|>", "<|tool_call|>", "<|/tool_call|>", _json_calls),
    Convention("hermes", "<tool_call>", "<tool_call>", "</tool_call>", _json_calls),
    Convention("tool_code", "```tool_code", "```tool_code", "```", _python_calls),
    Convention("llama3", "<|python_tag|>", "", "", _llama3_calls),
    Convention("llama3", '"parameters": dictionary of argument', "", "", _llama3_calls),
)
PLAIN = Convention("plain", "", "", "", lambda body: None)


def convention_for(template_source: str) -> Convention:
    """The row whose marker the template writes (the first in table order), with <think> reasoning when the
    template writes <think>; PLAIN (no calls) when none matches."""
    think = THINK_CLOSE in template_source
    for row in CONVENTIONS:
        if row.marker in template_source:
            return Convention(row.name, row.marker, row.open, row.close, row.calls, row.ids, think)
    return Convention("plain", "", "", "", PLAIN.calls, think=think)


def starts_in_reasoning(prompt_text: str) -> bool:
    """Whether a rendered prompt ends inside an open <think> (a template that opens the reasoning itself)."""
    last = prompt_text.rfind(THINK_OPEN)
    return last >= 0 and THINK_CLOSE not in prompt_text[last:] and not prompt_text[last + len(THINK_OPEN) :].strip()


# ---- streaming ------------------------------------------------------------------------------------------------


@dataclass
class Delta:
    content: str = ""
    reasoning: str = ""
    calls: list[tuple[str, dict]] = field(default_factory=list)


class ReplyParser:
    """The parsed reply of a growing text: .update(text) returns what was added since the last update;
    .finish(text) the rest, once the reply ended. Deltas concatenate to the final parse."""

    def __init__(self, convention: Convention, *, in_reasoning: bool = False):
        self.convention, self.in_reasoning = convention, in_reasoning
        self.last = Parsed()

    def update(self, text: str, *, final: bool = False) -> Delta:
        parsed = self.convention.parse(text, final=final, in_reasoning=self.in_reasoning)
        last = self.last
        delta = Delta(
            _grown(last.content, parsed.content),
            _grown(last.reasoning or "", parsed.reasoning or ""),
            parsed.calls[len(last.calls) :],
        )
        self.last = parsed
        return delta

    def finish(self, text: str) -> tuple[Delta, Parsed]:
        return self.update(text, final=True), self.last


def _grown(before: str, after: str) -> str:
    # a final parse may take back text a partial one showed only if the parser's holding rule failed
    assert after.startswith(before), "a reply's parse must only grow"
    return after[len(before) :]


# ---- messages from OpenAI's API -----------------------------------------------------------------------------------


def from_openai(messages: list) -> list:
    """Messages as OpenAI's chat API sends them, as chat templates read them (what vLLM and llama.cpp's server do
    before rendering): an assistant's tool-call arguments given as JSON text become the object they hold, and
    content given as a list of text parts becomes their text. Anything else is left for the chat's own checks."""
    converted = []
    for message in messages:
        if not isinstance(message, dict):
            converted.append(message)
            continue
        message = dict(message)
        content = message.get("content")
        if isinstance(content, list) and all(isinstance(p, dict) and p.get("type") == "text" for p in content):
            message["content"] = "".join(str(part.get("text", "")) for part in content)
        calls = message.get("tool_calls")
        if isinstance(calls, list):
            message["tool_calls"] = [_object_arguments(call) for call in calls]
        converted.append(message)
    return converted


def _object_arguments(call: object) -> object:
    function = call.get("function") if isinstance(call, dict) else None
    arguments = function.get("arguments") if isinstance(function, dict) else None
    if not isinstance(arguments, str):
        return call
    try:
        value = untrusted.loads(arguments)
    except untrusted.Unbounded:
        return call
    return {**call, "function": {**function, "arguments": value}} if isinstance(value, dict) else call
