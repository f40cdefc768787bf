"""The options apps use from the command line (docs/apps.md): tools and template variables for chat, and
structured output (a JSON schema, any JSON object, a regex, a Lark grammar) for chat and generate."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from .options import text_file

MAX_OPTION_FILE = 4 * 2**20  # bytes: a tools list, a schema or a grammar is text a person wrote


def _read(path: str, what: str) -> str:
    text_file(path)
    if Path(path).stat().st_size > MAX_OPTION_FILE:
        raise argparse.ArgumentTypeError(f"{path} is larger than {MAX_OPTION_FILE // 2**20} MiB, too large for {what}")
    try:
        return Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise argparse.ArgumentTypeError(f"cannot read {path}: {e}") from None


def _json_file(what: str, kind: type):
    def parse(path: str) -> Any:
        try:
            value = json.loads(_read(path, what))
        except (json.JSONDecodeError, RecursionError) as e:  # RecursionError: nested past Python's stack
            raise argparse.ArgumentTypeError(f"{path} is not JSON: {e}") from None
        if not isinstance(value, kind):
            raise argparse.ArgumentTypeError(f"{path} must hold {what}, a JSON {kind.__name__}")
        return value

    return parse


# `--tools FILE`: a JSON list of tool specs; raises argparse.ArgumentTypeError (examples/desktop/app.py uses it too)
read_tools_file = _json_file("a list of tool specs", list)


def template_var(text: str) -> tuple[str, Any]:
    """KEY=VALUE, VALUE read as JSON when it is JSON (true, 3, {"a": 1}) and as a string otherwise."""
    key, equals, value = text.partition("=")
    if not equals or not key.strip():
        raise argparse.ArgumentTypeError(f"must be KEY=VALUE, got {text!r}")
    try:
        return key.strip(), json.loads(value)
    except json.JSONDecodeError:
        return key.strip(), value
    except RecursionError:
        raise argparse.ArgumentTypeError(f"the value of {key.strip()!r} is JSON nested too deeply") from None


def add_chat_inputs(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("template inputs")
    g.add_argument(
        "--tools",
        type=read_tools_file,
        default=None,
        metavar="FILE",
        help='a JSON list of tools ({"type": "function", "function": {"name", "description", "parameters"}}) for '
        "the chat template; the model's tool calls are shown on stderr",
    )
    g.add_argument(
        "--template-var",
        type=template_var,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a variable for the chat template (VALUE as JSON when it parses, else text), e.g. enable_thinking=false; "
        "repeatable",
    )


def chat_inputs(args: argparse.Namespace) -> dict:
    """Keyword arguments of Model.conversation from add_chat_inputs' options."""
    return {"tools": args.tools, "template_vars": dict(args.template_var) or None}


def add_structured(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("structured output (pip install edgelm[structured])").add_mutually_exclusive_group()
    g.add_argument("--schema", type=_json_file("a JSON schema", dict), default=None, metavar="FILE",
                   help="the output is JSON that matches this JSON schema")  # fmt: skip
    g.add_argument("--json-object", action="store_true", help="the output is a JSON object")
    g.add_argument("--regex", default=None, help="the output matches this regular expression")
    g.add_argument("--grammar", type=lambda path: _read(path, "a grammar"), default=None, metavar="FILE",
                   help="the output matches this Lark grammar (llguidance's dialect)")  # fmt: skip


def structured_options(args: argparse.Namespace) -> dict:
    """Keyword arguments of generate/stream/send from add_structured's options."""
    if args.schema is not None:
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "cli", "schema": args.schema}}}
    if args.json_object:
        return {"response_format": {"type": "json_object"}}
    return {name: getattr(args, name) for name in ("regex", "grammar") if getattr(args, name) is not None}


def show_tool_calls(result, stream) -> None:
    """The tool calls of a chat reply, one line each on `stream`."""
    for call in result.tool_calls:
        print(f"[tool call {call.name} {json.dumps(call.arguments, ensure_ascii=False)} id {call.id}]", file=stream)
