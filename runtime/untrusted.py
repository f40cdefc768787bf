"""Bounds for structure that comes from outside: a model's output, a request body, a JSON schema, a tool spec.

Every place that parses or walks such structure (runtime/tool_calls.py, runtime/constraints.py, runtime/tools.py,
edgelm/serve/) measures it here, so the bounds are the same everywhere and a hostile input is a clean error,
never a RecursionError, a C stack overflow (llguidance converts a schema recursively) or an unbounded allocation:

- nesting: lists and dicts inside each other, at most MAX_DEPTH (serde_json's own limit, which llguidance applies
  to a schema's JSON text, so no schema llguidance would compile is refused here);
- numbers: integers of at most MAX_INT_DIGITS digits (Python's int/str conversion limit), finite floats only
  (`NaN`, `Infinity` and `1e999` are not JSON; strict parsers refuse them);
- sizes: at most MAX_NODES lists, dicts and values in one structure.

`loads` is strict JSON text in, a bounded value out; `check` bounds a value a caller built (a Python dict);
both raise Unbounded (a ValueError), which each caller turns into its own error.
"""

from __future__ import annotations

import json
import math
import sys
from typing import Any

MAX_DEPTH = 128  # nested lists and dicts (serde_json's recursion limit; Python's json stops near 1,000)
MAX_INT_DIGITS = 4_300  # sys.int_info.default_max_str_digits: longer integers cannot even be printed
MAX_NODES = 1_000_000  # values in one structure: a 32 MiB request body holds at most ~10M
MAX_CALL_CHARS = 1_000_000  # one tool call's text as a model wrote it (ast.parse takes ~1 KB a character)


class Unbounded(ValueError):
    """A structure past one of the bounds above, or JSON text that is not strict JSON."""


def _constant(name: str):
    raise Unbounded(f"{name} is not JSON")


def _float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise Unbounded(f"{text[:20]} is beyond a float's range")
    return value


def _int(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise Unbounded(f"an integer of {len(text):,} digits (at most {MAX_INT_DIGITS:,})")
    return int(text)


def loads(text: str | bytes | bytearray) -> Any:
    """Strict JSON text as a value within the bounds; Unbounded for text that is not JSON or is past a bound."""
    try:
        value = json.loads(text, parse_constant=_constant, parse_float=_float, parse_int=_int)
    except RecursionError:
        raise Unbounded(f"nested more than {MAX_DEPTH} deep") from None
    except Unbounded:
        raise
    except (ValueError, UnicodeDecodeError) as e:  # JSONDecodeError, bytes that are not UTF-8
        raise Unbounded(f"not valid JSON: {e}") from None
    check(value)
    return value


def check(value: Any, *, max_depth: int = MAX_DEPTH) -> None:
    """Unbounded when value nests lists, tuples and dicts more than max_depth deep, holds more than MAX_NODES
    values, an integer past MAX_INT_DIGITS or a float that is not finite. Walked without recursion."""
    pending: list[tuple[Any, int]] = [(value, 0)]
    nodes = 0
    while pending:
        item, depth = pending.pop()
        nodes += 1
        if nodes > MAX_NODES:
            raise Unbounded(f"more than {MAX_NODES:,} values")
        if isinstance(item, dict):
            children = [*item.keys(), *item.values()]
        elif isinstance(item, (list, tuple)):
            children = item
        else:
            if isinstance(item, float) and not math.isfinite(item):
                raise Unbounded(f"{item} is not a JSON number")
            if isinstance(item, int) and not isinstance(item, bool) and item.bit_length() > _MAX_INT_BITS:
                raise Unbounded(f"an integer of more than {MAX_INT_DIGITS:,} digits")
            continue
        if depth >= max_depth:
            raise Unbounded(f"nested more than {max_depth} deep")
        pending.extend((child, depth + 1) for child in children)


def depth_of(text: str, max_depth: int = MAX_DEPTH) -> int:
    """How deep brackets ([, {, () nest in text, ignoring quoting: a cheap upper bound, counted up to max_depth + 1,
    for text about to go to a recursive parser (Python's ast)."""
    level = deepest = 0
    for char in text:
        if char in "([{":
            level += 1
            if level > deepest:
                deepest = level
                if deepest > max_depth:
                    break
        elif char in ")]}":
            level = max(level - 1, 0)
    return deepest


_MAX_INT_BITS = int(MAX_INT_DIGITS * math.log2(10)) + 1
assert sys.getrecursionlimit() > MAX_DEPTH * 2, "the bounds assume Python's default recursion limit"
