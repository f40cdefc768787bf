"""How much text a chat template's operation would build, bounded before the operation runs.

The chat template sandbox asks these functions (through costs.py) before every filter, string method,
operator, format and concatenation a template runs, and refuses the operation when the bound passes a
limit, so a template that asks for gigabytes (`'%999999999s' % 1`, `x|indent(10**8)`, `tojson(indent=...)`
of a deep list) fails before a byte of it is allocated. A bound is never smaller than the real result and may be larger;
each is a Cost: the characters of the new strings and the entries of the new lists, tuples and dicts.
Every function walks at most about `cap` characters' worth of its input, so asking is cheap too.

Only data can be measured: text, numbers, booleans, None, lists, tuples, dicts (and their views), ranges
and bytes. Anything else (a function, a macro, a namespace, a cycler) raises SecurityError when it is
about to become text, since its repr would show internals and a heap address.
"""

from __future__ import annotations

import json
from collections.abc import ItemsView, KeysView, ValuesView
from itertools import chain
from typing import Any, NamedTuple

from jinja2.exceptions import SecurityError
from jinja2.runtime import Macro, Undefined
from jinja2.utils import Namespace
from markupsafe import Markup

ITEM_BYTES = 100  # a list slot plus the small object it may hold (a one-character string, a pair, an empty list)
HUGE = 10**12  # a size that passes every limit: a width of more than nine digits, an unbounded repeat
ESCAPE_GROWTH = 5  # markupsafe's escape turns one character into at most five ('"' -> '&#34;')
CASE_GROWTH = 3  # upper(), lower(), title(), casefold() of one character give at most three ('ΐ'.upper())
_SLICE = 1 << 16  # texts are measured in slices of this many characters, so no full copy is made
TEXT_PER_ENTRY = 256  # characters of a string that weigh as much as one entry in a comparison (one memcmp)
_END = object()
_VIEWS = (KeysView, ValuesView, ItemsView)
_CONTAINERS = (list, tuple, dict, set, frozenset, *_VIEWS)


class Cost(NamedTuple):
    """What an operation would build: characters of new text and entries of new containers."""

    chars: int = 0
    items: int = 0
    width: int = 4  # bytes per character; 1 when every text involved is ASCII

    @property
    def bytes(self) -> int:
        return self.chars * self.width + self.items * ITEM_BYTES


def width(*texts: Any) -> int:
    """Bytes per character of text built from texts: 1 if all are ASCII str (an O(1) check), else 4."""
    return 1 if all(isinstance(text, str) and text.isascii() for text in texts) else 4


def int_digits(number: int) -> int:
    """An upper bound of len(str(number)): log10(2) digits per bit, plus sign and rounding."""
    return number.bit_length() * 30103 // 100000 + 2


def not_data(value: Any) -> SecurityError:
    if isinstance(value, type):
        kind = "class"
    elif isinstance(value, (Macro, Namespace)):
        kind = type(value).__name__.lower().lstrip("_")
    elif hasattr(value, "__next__"):
        kind = "generator"
    else:
        kind = "function" if callable(value) else type(value).__name__
    return SecurityError(f"a {kind} cannot be turned into text (only text, numbers, booleans, lists and dicts)")


def repr_size(text: str, *, ascii_only: bool = False) -> int:
    """An upper bound of len(repr(text)), or of len(ascii(text)) when ascii_only."""
    convert = ascii if ascii_only else repr
    if len(text) <= _SLICE:
        return len(convert(text))
    total = 2 + text.count("'")  # a slice may pick other quotes than the whole text, which escapes every "'"
    for start in range(0, len(text), _SLICE):
        total += len(convert(text[start : start + _SLICE])) - 2
    return total


def json_text_size(text: str, *, ensure_ascii: bool) -> int:
    """Exactly len(json.dumps(text, ensure_ascii=...)): JSON escapes one character at a time."""
    total = 2
    for start in range(0, max(len(text), 1), _SLICE):
        total += len(json.dumps(text[start : start + _SLICE], ensure_ascii=ensure_ascii)) - 2
    return total


class Shape(NamedTuple):
    """A value as a comparison or a hash walks it: entries visited, and how deep containers nest."""

    entries: int
    depth: int


def _entries(value: Any) -> int | None:
    """The weight of a value that is not a container, None for a container."""
    if isinstance(value, (str, bytes)):
        return 1 + len(value) // TEXT_PER_ENTRY
    return None if isinstance(value, _CONTAINERS) else 1


PLAIN_TYPES = frozenset({str, int, float, bool, type(None)})  # values neither measured nor copied item by item


def _flat_shape(value: list | tuple) -> Shape | None:
    """The shape of a list or tuple of numbers and plain strings only, without the walk's Python step per item (a
    template that appends to a list in a loop measures each longer copy: 1,000 appends took 1.8 s walked); None
    where it holds anything else."""
    kinds = set(map(type, value))
    if not kinds <= PLAIN_TYPES:
        return None
    if str not in kinds:
        return Shape(1 + len(value), 1)
    return Shape(1 + sum([1 + len(v) // TEXT_PER_ENTRY if type(v) is str else 1 for v in value]), 1)


def shape(value: Any, known: dict[int, Shape], kept: list, *, cap: int, max_depth: int) -> Shape:
    """The entries that comparing, hashing or sorting value visits: every item of every list, tuple, set and
    dict (keys and values) in it, reached through each reference again, as Python's recursive comparison
    does (a list holding one list twice counts it twice); and the depth of its containers.

    Each container is walked once: its shape goes into known by id, and kept holds it so that no id is reused
    while known lives; a new container holding known ones costs one pass over its own items. Stops, with a
    partial shape past a bound, once the entries pass cap or the nesting passes max_depth.
    """
    weight = _entries(value)
    if weight is not None:
        return Shape(weight, 0)
    stack: list[list] = []  # per container being walked: [container, its items, entries so far, deepest child]
    entering = value
    while True:
        if entering is not _END:
            found = known.get(id(entering))
            if found is None and type(entering) in (list, tuple):
                found = _flat_shape(entering)
                if found is not None:
                    known[id(entering)] = found
                    kept.append(entering)
            if found is None:
                items = chain.from_iterable(entering.items()) if isinstance(entering, dict) else entering
                if isinstance(entering, ItemsView):  # a view is made afresh by each call: walked, never kept
                    items = chain.from_iterable(entering)
                stack.append([entering, iter(items), 1, 0])
                if len(stack) > max_depth:
                    return Shape(0, len(stack))
            elif not stack:
                return found
            else:
                _add(stack[-1], found)
            entering = _END
        frame = stack[-1]
        item = next(frame[1], _END)
        if item is _END:
            stack.pop()
            done = Shape(frame[2], frame[3] + 1)
            if not isinstance(frame[0], _VIEWS):
                known[id(frame[0])] = done
                kept.append(frame[0])
            if not stack:
                return done
            _add(stack[-1], done)
        else:
            weight = _entries(item)
            if weight is None:
                entering = item
            else:
                frame[2] += weight
        if stack[-1][2] > cap:
            return Shape(stack[-1][2], 0)


def _add(frame: list, child: Shape) -> None:
    frame[2] += child.entries
    frame[3] = max(frame[3], child.depth)


def _scalar_size(value: Any, nested: bool) -> int | None:
    """len(str(value)) (len(repr(value)) when nested in a container) of a scalar, None for containers."""
    if isinstance(value, str):
        if not nested:
            return len(value)
        return repr_size(value) + (8 if isinstance(value, Markup) else 0)  # Markup('...')
    if value is None or isinstance(value, bool):
        return 5
    if isinstance(value, int):
        return int_digits(value)
    if isinstance(value, float):
        return 24  # '-2.2250738585072014e-308'
    if isinstance(value, Undefined):
        return 9 if nested else 0  # jinja's Undefined prints as '' and reprs as 'Undefined'
    if isinstance(value, bytes):
        return 4 * len(value) + 3  # b'\xff...'
    if isinstance(value, range):
        return 3 * int_digits(max(abs(value.start), abs(value.stop), abs(value.step))) + 12
    return None


def text_size(value: Any, cap: int) -> int:
    """An upper bound of len(str(value)), or any number above cap once the result must pass it."""
    total, stack = 0, [iter((value,))]
    while stack and total <= cap:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        size = _scalar_size(item, nested=len(stack) > 1)
        if size is not None:
            total += size
            continue
        if isinstance(item, (list, tuple, KeysView, ValuesView)):
            children = item
        elif isinstance(item, (dict, ItemsView)):
            children = chain.from_iterable(item.items() if isinstance(item, dict) else item)
        else:
            raise not_data(item)
        total += 6 * len(item) + 14  # brackets, ', ' and ': ' or '(, )' around each entry, 'dict_items([...])'
        if total <= cap:  # every entry takes at least a character: a long container is refused unread
            stack.append(iter(children))
    return total


def json_size(value: Any, *, ensure_ascii: bool, indent: Any, separators: Any, cap: int) -> tuple[int, int]:
    """An upper bound of len(json.dumps(value, ...)), and the number of values json.dumps visits."""
    if isinstance(indent, str):
        pad = len(indent)
    else:
        pad = max(indent, 0) if isinstance(indent, int) else 0
    item_sep, key_sep = (",", ": ") if indent is not None else (", ", ": ")
    if isinstance(separators, (tuple, list)) and len(separators) == 2:
        item_sep, key_sep = (text if isinstance(text, str) else "" for text in separators)
    total, nodes, stack = 0, 0, [iter((value,))]
    while stack and total <= cap:
        item = next(stack[-1], _END)
        if item is _END:
            stack.pop()
            continue
        nodes += 1
        if isinstance(item, str):
            total += json_text_size(item, ensure_ascii=ensure_ascii)
        elif item is None or isinstance(item, (bool, float)):
            total += 24
        elif isinstance(item, int):
            total += int_digits(item)
        elif isinstance(item, (list, tuple, dict)):
            depth, count = len(stack), len(item)
            total += 2 + count * len(item_sep) + count
            if indent is not None:  # a newline and depth * indent before each entry and the closing bracket
                total += (count + 1) * (1 + pad * depth)
            if isinstance(item, dict):
                total += count * (len(key_sep) + 26)  # a key that is not text becomes "..." of at most 24
            if total <= cap:
                stack.append(iter(chain.from_iterable(item.items()) if isinstance(item, dict) else item))
        # anything else makes json.dumps raise TypeError before it writes much
    return total, nodes


def _number(fmt: str, at: int, args: list, next_arg: int) -> tuple[int, int, int]:
    """A width or precision of a %-format at fmt[at]: (value, position after it, next positional argument)."""
    if at < len(fmt) and fmt[at] == "*":
        value = args[next_arg] if next_arg < len(args) else 0
        return (abs(value) if isinstance(value, int) else 0), at + 1, next_arg + 1
    end = at
    while end < len(fmt) and fmt[end].isdigit() and fmt[end].isascii():
        end += 1
    if end - at > 9:
        return HUGE, end, next_arg
    return (int(fmt[at:end]) if end > at else 0), end, next_arg


def converted_size(value: Any, conversion: str, cap: int) -> int:
    """An upper bound of one %-conversion or str.format field of value, before width and precision."""
    if conversion in ("r", "a"):
        if isinstance(value, str):
            return repr_size(value, ascii_only=conversion == "a") + (8 if isinstance(value, Markup) else 0)
        return text_size([value], cap)  # a repr: the size of the value inside a list
    if conversion == "c":
        return 1
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return text_size(value, cap)
    if isinstance(value, int):
        return 2 * value.bit_length() + 8  # binary digits with a separator every four, sign and prefix
    return 2 * 330  # 'f' of 1.8e308, with separators


def percent_size(fmt: str | bytes, values: Any, cap: int) -> int:
    """An upper bound of len(fmt % values), following the grammar of printf-style formatting.

    Per conversion: the width, the precision and the converted value (a mapping key may hold nested
    parentheses). A format that is malformed gets a bound too; the real `%` then raises its own error.
    """
    if isinstance(fmt, bytes):
        fmt = fmt.decode("latin-1")
    args = list(values) if type(values) is tuple else [values]
    total, at, next_arg = 0, 0, 0
    while total <= cap:
        percent = fmt.find("%", at)
        if percent < 0:
            return total + len(fmt) - at
        total += percent - at
        at = percent + 1
        if fmt.startswith("%", at):
            total, at = total + 1, at + 1
            continue
        value, keyed = None, False
        if fmt.startswith("(", at):
            depth, end = 1, at + 1
            while end < len(fmt) and depth:
                depth += {"(": 1, ")": -1}.get(fmt[end], 0)
                end += 1
            try:
                value, keyed = values[fmt[at + 1 : end - 1]], True
            except Exception:  # not a mapping, or no such key: the real `%` raises
                value, keyed = None, True
            at = end
        while at < len(fmt) and fmt[at] in "-+ #0":
            at += 1
        field_width, at, next_arg = _number(fmt, at, args, next_arg)
        precision = 0
        if fmt.startswith(".", at):
            precision, at, next_arg = _number(fmt, at + 1, args, next_arg)
        if at < len(fmt) and fmt[at] in "hlL":
            at += 1
        if at >= len(fmt):
            return total
        conversion, at = fmt[at], at + 1
        if not keyed:
            value = args[next_arg] if next_arg < len(args) else None
            next_arg += 1
        total += field_width + precision + converted_size(value, conversion, cap)
    return total


def format_spec_extra(spec: str) -> int:
    """An upper bound of what a str.format spec adds to a value: its width and precision."""
    if len(spec) > 100:  # no valid spec of a built-in type is this long
        return HUGE
    total, digits = 0, ""
    for char in spec + " ":
        if char.isdigit() and char.isascii():
            digits += char
        elif digits:
            total += HUGE if len(digits) > 9 else int(digits)
            digits = ""
    return total


def line_count(text: str) -> int:
    """An upper bound of len(text.splitlines()) (+1), without splitting."""
    breaks = "\n\r\v\f\x1c\x1d\x1e" if text.isascii() else "\n\r\v\f\x1c\x1d\x1e\x85\u2028\u2029"
    return sum(text.count(char) for char in breaks) + 1
