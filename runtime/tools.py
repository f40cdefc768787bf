"""Tools for a chat template: JSON-schema function specs, or Python functions described as transformers describes them.

A tool is what transformers' `apply_chat_template(tools=[...])` takes: a dict
(`{"type": "function", "function": {"name", "description", "parameters"}}`) passed to the template as it is,
or a Python function with type hints and a Google-style docstring, turned into such a dict by
`tool_schema` the way `transformers.utils.get_json_schema` does (same regular expressions, same type
mapping), without importing transformers:

    def get_weather(city: str, unit: Literal["C", "F"] = "C") -> str:
        '''The current weather in a city.

        Args:
            city: The city's name.
            unit: The temperature unit.
        '''
"""

from __future__ import annotations

import inspect
import json
import re
import types
from collections.abc import Callable
from enum import Enum
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from .errors import ChatTemplateError

# transformers' chat_template_utils expressions, unchanged, so a docstring parses the same way
DESCRIPTION = re.compile(r"^(.*?)[\n\s]*(Args:|Returns:|Raises:|\Z)", re.DOTALL)
ARGS = re.compile(r"\n\s*Args:\n(.*?)[\n\s]*(Returns:|Raises:|\Z)", re.DOTALL)
ARG_SPLIT = re.compile(
    r"""
(?:^|\n)
([ \t]*)(\w+)(?:[ \t]*\([^()\n]*\))?:\s*
(.*?)\s*
(?=\n(?!\1[ \t])[ \t]*\w+(?:[ \t]*\([^()\n]*\))?:|\Z)
""",
    re.DOTALL | re.VERBOSE,
)
RETURNS = re.compile(r"\n\s*Returns:\n\s*(.*?)[\n\s]*(Raises:|\Z)", re.DOTALL)
CHOICES = re.compile(r"\(choices:\s*(.*?)\)\s*$", re.IGNORECASE)

SCALARS = {int: "integer", float: "number", str: "string", bool: "boolean", type(None): "null"}
BASIC = {**{kind: {"type": name} for kind, name in SCALARS.items()}, list: {"type": "array"}}
BASIC |= {tuple: {"type": "array"}, dict: {"type": "object"}, Any: {}}


def _enum(values: list) -> dict:
    kinds = list(dict.fromkeys(SCALARS[type(value)] for value in values))
    return {"type": kinds[0] if len(kinds) == 1 else kinds, "enum": values}


def _hint_schema(hint: Any, where: str) -> dict:
    """The JSON schema of one type hint (transformers' _parse_type_hint)."""
    origin, args = get_origin(hint), get_args(hint)
    if origin is None and isinstance(hint, type) and issubclass(hint, Enum):
        values = [member.value for member in hint]
        if not values or any(type(value) not in SCALARS for value in values):
            raise ChatTemplateError(
                f"{where}: the Enum {hint.__name__} needs members with int, float, str, bool values"
            )
        return _enum(values)
    if origin is None:
        if hint not in BASIC:
            raise ChatTemplateError(
                f"{where}: cannot describe the type {hint!r} as JSON; use int, float, str, bool, Enum, Literal, "
                "and list, tuple, dict or Union of them, or pass the tool's JSON schema instead"
            )
        return dict(BASIC[hint])
    if origin is Union or origin is types.UnionType:
        subtypes = [_hint_schema(arg, where) for arg in args if arg is not type(None)]
        if len(subtypes) == 1:
            schema = subtypes[0]
        elif all(s.keys() == {"type"} and isinstance(s["type"], str) for s in subtypes):
            names = sorted({s["type"] for s in subtypes})
            schema = {"type": names[0] if len(names) == 1 else names}
        else:
            schema = {"anyOf": subtypes}
        if type(None) in args:
            schema["nullable"] = True
        return schema
    if origin is Literal and args:
        if any(type(arg) not in SCALARS for arg in args):
            raise ChatTemplateError(f"{where}: a Literal may only list int, float, str, bool or None values")
        return _enum(list(args))
    if origin is list:
        return {"type": "array", "items": _hint_schema(args[0], where)} if args else {"type": "array"}
    if origin is tuple:
        if not args:
            return {"type": "array"}
        if len(args) == 1 or ... in args:
            raise ChatTemplateError(f"{where}: use list[...] rather than a one-element or open-ended tuple")
        return {"type": "array", "prefixItems": [_hint_schema(arg, where) for arg in args]}
    if origin is dict:
        schema = {"type": "object"}
        if len(args) == 2:
            schema["additionalProperties"] = _hint_schema(args[1], where)
        return schema
    raise ChatTemplateError(f"{where}: cannot describe the type {hint!r} as JSON")


def _docstring(doc: str) -> tuple[str | None, dict[str, str], str | None]:
    """A Google-style docstring's description, argument descriptions and Returns text."""
    description, args, returns = DESCRIPTION.search(doc), ARGS.search(doc), RETURNS.search(doc)
    described = {}
    if args is not None:
        block = "\n".join(line for line in args.group(1).split("\n") if line.strip())
        described = {m[1]: re.sub(r"\s*\n+\s*", " ", m[2].strip()) for m in ARG_SPLIT.findall(block)}
    return (
        description.group(1).strip() if description else None,
        described,
        returns.group(1).strip() if returns else None,
    )


def tool_schema(func: Callable) -> dict:
    """The tool spec of a Python function, as transformers.utils.get_json_schema(func) gives it;
    ChatTemplateError when a parameter has no type hint or no description."""
    name = getattr(func, "__name__", "operation")
    doc = inspect.getdoc(func)
    if not doc:
        raise ChatTemplateError(f"the tool {name} has no docstring to describe it")
    description, described, returns = _docstring(doc.strip())
    try:
        hints = get_type_hints(func)
    except Exception as e:  # a hint naming something undefined: NameError and friends
        raise ChatTemplateError(f"the tool {name}'s type hints cannot be read: {e}") from None
    try:
        signature = inspect.signature(func)
    except (ValueError, TypeError) as e:  # a builtin or class without one: `int`, `type`
        raise ChatTemplateError(f"the tool {name} has no signature to describe it: {e}") from None
    first = next(iter(signature.parameters), None)
    receiver = (
        first
        if first in {"self", "cls"} and signature.parameters[first].annotation is inspect.Parameter.empty
        else None
    )
    required = []
    for parameter in signature.parameters.values():
        if parameter.name == receiver:
            continue
        if parameter.annotation is inspect.Parameter.empty:
            raise ChatTemplateError(f"the tool {name}'s argument {parameter.name} has no type hint")
        if parameter.default is inspect.Parameter.empty:
            required.append(parameter.name)
    properties, returned = {}, None
    for arg, hint in hints.items():
        if arg == receiver:
            continue
        if arg == "return":
            try:
                returned = _hint_schema(hint, f"the tool {name}'s return")
            except ChatTemplateError:  # the model never writes the return value: leave it out
                pass
            continue
        schema = _hint_schema(hint, f"the tool {name}'s argument {arg}")
        if arg not in described:
            raise ChatTemplateError(f"the tool {name}'s docstring has no description for the argument {arg!r}")
        text = described[arg]
        choices = CHOICES.search(text)
        if choices:
            try:
                schema["enum"] = [c.strip() if isinstance(c, str) else c for c in json.loads(choices.group(1))]
            except json.JSONDecodeError:
                raise ChatTemplateError(
                    f"the tool {name}'s argument {arg}: (choices: ...) is not a JSON list"
                ) from None
            text = text[: choices.start()].strip()
        schema["description"] = text
        properties[arg] = schema
    parameters: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        parameters["required"] = required
    spec: dict[str, Any] = {"name": name, "description": description, "parameters": parameters}
    if returned is not None:
        if returns is not None:
            returned["description"] = returns
        spec["return"] = returned
    return {"type": "function", "function": spec}


def tool_specs(tools: Any) -> list[dict] | None:
    """The tools list a template receives: dicts as given, functions described by tool_schema."""
    if tools is None:
        return None
    if not isinstance(tools, (list, tuple)):
        raise ChatTemplateError(f"tools must be a list of tool specs (dicts) or functions, got {type(tools).__name__}")
    specs = []
    for index, tool in enumerate(tools):
        if isinstance(tool, dict):
            specs.append(tool)
        elif callable(tool):
            specs.append(tool_schema(tool))
        else:
            raise ChatTemplateError(f"tool {index} is a {type(tool).__name__}, not a dict or a function")
    return specs


def tool_name(spec: dict) -> str | None:
    """The function name of a tool spec, OpenAI's nested form or a flat {"name": ...}."""
    inner = spec.get("function", spec)
    name = inner.get("name") if isinstance(inner, dict) else None
    return name if isinstance(name, str) else None


def tool_parameters(spec: dict) -> dict:
    """The JSON schema of a tool's arguments ({} when the spec gives none: any object)."""
    inner = spec.get("function", spec)
    parameters = inner.get("parameters") if isinstance(inner, dict) else None
    return parameters if isinstance(parameters, dict) else {"type": "object"}
