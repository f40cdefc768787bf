"""What each operation a chat template runs would build, bounded from its inputs before it runs: turning
values into text (`~`, printing, join), operators (`+`, `*`, `%`, `**`), every jinja filter and every
string method. The sizes of values and formats come from sizes.py; the sandbox admits each Cost to the
render's budget (limits.py) first. None means "not known here": the sandbox then counts the result after
the call (result_cost).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from markupsafe import Markup

from .limits import MAX_INT_BITS, MAX_OUTPUT_CHARS, LimitError
from .sizes import (
    CASE_GROWTH,
    ESCAPE_GROWTH,
    Cost,
    json_size,
    line_count,
    percent_size,
    text_size,
    width,
)


def text_cost(*values: Any) -> Cost:
    """Turning values into one text, as `~`, print and str() do; refuses what is not data."""
    return texts_cost(values)


def texts_cost(values: Iterable) -> Cost:
    size, markup, narrow = 0, False, True
    for value in values:
        size += text_size(value, MAX_OUTPUT_CHARS)
        if size > MAX_OUTPUT_CHARS:
            break  # refused: no need to read the rest
        markup = markup or isinstance(value, Markup)
        narrow = narrow and isinstance(value, str) and value.isascii()
    return Cost(size * (ESCAPE_GROWTH if markup else 1), 0, 1 if narrow else 4)  # Markup escapes what it joins


def join_cost(separator: str | bytes, items: Any) -> Cost:
    """separator.join(items), items already in a list (or anything with a length)."""
    items = items if hasattr(items, "__len__") else ()
    joined = texts_cost(items)
    return Cost(joined.chars + len(separator) * max(len(items) - 1, 0), len(items), joined.width)


def result_cost(value: Any) -> Cost:
    """What an operation no bound knows did build, counted after the fact."""
    if isinstance(value, str):
        return Cost(len(value), 0, width(value))
    if isinstance(value, bytes):
        return Cost(len(value), 0, 1)
    return Cost(0, len(value)) if isinstance(value, (list, tuple, dict)) else Cost()


def operator_cost(operator: str, left: Any, right: Any) -> Cost:
    """What `left operator right` builds; ints that would pass MAX_INT_BITS are refused here."""
    if operator == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            return text_cost(left, right)
        if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            return Cost(0, len(left) + len(right))
    elif operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(count, int):
                size = len(sequence) * max(count, 0)
                return Cost(size, 0, width(sequence)) if isinstance(sequence, (str, bytes)) else Cost(0, size)
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise LimitError(f"a product of more than {MAX_INT_BITS:,} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_BITS:  # 10 ** 10 ** 10 would take hours
                raise LimitError(f"{left} ** {right} is too large a number")
    elif operator == "%" and isinstance(left, (str, bytes)):
        size = percent_size(left, right, MAX_OUTPUT_CHARS)
        return Cost(size * (ESCAPE_GROWTH if isinstance(left, Markup) else 1))
    return Cost()


def _arg(args: tuple, kwargs: dict, index: int, name: str, default: Any = None) -> Any:
    """An argument as a call would bind it, without failing on a bad call (the real call then raises)."""
    return args[index] if len(args) > index else kwargs.get(name, default)


def _int(value: Any) -> int:
    return value if isinstance(value, int) else 0


def _text_cost(value: Any, cap: int, growth: int = 1, items: int = 0) -> Cost:
    return Cost(text_size(value, cap) * growth, items, width(value))


def _cased_cost(value: Any, cap: int, items: int = 0) -> Cost:
    """upper(), title(), ...: ASCII keeps its length, other text may grow (see CASE_GROWTH)."""
    return _text_cost(value, cap, 1 if isinstance(value, str) and value.isascii() else CASE_GROWTH, items)


def _occurrences(text: Any, old: Any, count: Any, size: int) -> int:
    """How many replacements text.replace(old, new, count) makes, at most."""
    found = size + 1
    if isinstance(text, (str, bytes)) and type(old) is type(text):
        found = text.count(old) if old else len(text) + 1
    return min(found, count) if isinstance(count, int) and count >= 0 else found


def _replace_cost(text: Any, old: Any, new: Any, count: Any, cap: int) -> Cost:
    size = text_size(text, cap)
    growth = max(text_size(new, cap) - text_size(old, cap), 0)
    return Cost(size + _occurrences(text, old, count, size) * growth, 0, width(text, new))


def _indent_cost(text: Any, indent: Any, cap: int) -> Cost:
    size = text_size(text, cap)
    pad = len(indent) if isinstance(indent, str) else _int(indent)
    lines = line_count(text) + 1 if isinstance(text, str) else size + 2
    return Cost(3 * size + lines * (pad + 1) + pad, lines, width(text, indent if isinstance(indent, str) else ""))


def _sequence_length(value: Any) -> int:
    return len(value) if hasattr(value, "__len__") else 0


def filter_cost(name: str, value: Any, args: tuple, kwargs: dict, cap: int) -> Cost | None:
    """What jinja's filter `name` builds from value and its arguments; None for a filter not listed here.

    join and sum are not listed: filters.py replaces them with versions that measure their items.
    Lazy filters (map, select, items, ...) build nothing up front; what consumes them is counted.
    """
    if name in _SMALL_FILTERS:
        return Cost()
    for costs in (_text_filter_cost, _encoding_filter_cost, _collection_filter_cost):
        cost = costs(name, value, args, kwargs, cap)
        if cost is not None:
            return cost
    return None


def _text_filter_cost(name: str, value: Any, args: tuple, kwargs: dict, cap: int) -> Cost | None:
    """Filters that give a changed copy of a text: case, escaping, padding, replacing."""
    if name in ("upper", "lower", "capitalize"):
        return _cased_cost(value, cap)
    if name == "title":  # splits into words first
        return _cased_cost(value, cap, items=text_size(value, cap))
    if name in ("string", "safe", "trim"):
        return _text_cost(value, cap)
    if name == "striptags":  # joins the text's words again
        return _text_cost(value, cap, items=text_size(value, cap) // 2 + 1)
    if name in ("e", "escape", "forceescape"):
        return _text_cost(value, cap, ESCAPE_GROWTH)
    if name == "center":
        return Cost(max(text_size(value, cap), _int(_arg(args, kwargs, 0, "width", 80))), 0, width(value))
    if name == "indent":
        return _indent_cost(value, _arg(args, kwargs, 0, "width", 4), cap)
    if name == "replace":
        old, new = _arg(args, kwargs, 0, "old", ""), _arg(args, kwargs, 1, "new", "")
        return _replace_cost(value, old, new, _arg(args, kwargs, 2, "count"), cap)
    if name == "truncate":
        return Cost(text_size(value, cap) + text_size(_arg(args, kwargs, 2, "end", "..."), cap), 2)
    if name == "filesizeformat":
        return Cost(64)
    return None


def _encoding_filter_cost(name: str, value: Any, args: tuple, kwargs: dict, cap: int) -> Cost | None:
    """Filters that write a value in another notation: %-format, URL, XML attributes, JSON."""
    if name == "format":  # soft_str(value) % (kwargs or args)
        if not isinstance(value, str):
            size = text_size(value, cap)
            if size > cap:
                return Cost(size)
            value = str(value)
        return Cost(percent_size(value, kwargs or args, cap))
    if name == "urlencode":  # %XX for each of up to four UTF-8 bytes of a character
        return Cost(12 * text_size(value, cap) + 2, _sequence_length(value), 1)
    if name == "xmlattr":
        return Cost(ESCAPE_GROWTH * text_size(value, cap) + 8 * _sequence_length(value), _sequence_length(value))
    if name == "tojson":
        chars, nodes = json_size(
            value,
            ensure_ascii=bool(_arg(args, kwargs, 0, "ensure_ascii", False)),
            indent=_arg(args, kwargs, 1, "indent"),
            separators=_arg(args, kwargs, 2, "separators"),
            cap=cap,
        )
        return Cost(chars, 3 * nodes)
    return None


def _collection_filter_cost(name: str, value: Any, args: tuple, kwargs: dict, cap: int) -> Cost | None:
    """Filters that build lists (or sets, or sorted pairs) from a sequence or a text's words."""
    if name == "wordcount":  # finds every word first
        return Cost(0, text_size(value, cap) // 2 + 1)
    if name in ("list", "sort", "reverse"):
        if name == "reverse" and isinstance(value, str):
            return Cost(len(value), 0, width(value))
        return Cost(0, len(value) if isinstance(value, str) else _sequence_length(value))
    if name in ("unique", "dictsort", "groupby"):  # a set or sorted pairs beside the result
        return Cost(0, 4 * _sequence_length(value))
    if name == "batch":
        count, per_batch = _sequence_length(value), _int(_arg(args, kwargs, 0, "linecount"))
        fill = per_batch if _arg(args, kwargs, 1, "fill_with") is not None else 0
        return Cost(0, count + count // max(per_batch, 1) + max(fill, 0) + 1)
    if name == "slice":
        return Cost(0, _sequence_length(value) + 2 * max(_int(_arg(args, kwargs, 0, "slices")), 0) + 1)
    return None


_SMALL_FILTERS = frozenset(
    "abs attr count d default first float int items last length map max min random reject rejectattr round "
    "select selectattr".split()
)


def method_cost(receiver: Any, name: str, args: tuple, kwargs: dict, cap: int) -> Cost | None:
    """What calling receiver.name(*args, **kwargs) builds, for text, bytes, containers and ints; else None."""
    if isinstance(receiver, (str, bytes)):
        cost = _text_method_cost(receiver, name, args, kwargs, cap)
        if cost is not None and isinstance(receiver, Markup):  # Markup's methods escape their arguments
            cost = cost._replace(chars=cost.chars * ESCAPE_GROWTH)
        return cost
    if isinstance(receiver, (list, tuple, dict)) and name == "copy":
        return Cost(0, len(receiver))
    if isinstance(receiver, dict) and name == "fromkeys":
        keys = _arg(args, kwargs, 0, "iterable")
        return Cost(0, len(keys)) if hasattr(keys, "__len__") else None
    if isinstance(receiver, int) and name == "to_bytes":
        return Cost(max(_int(_arg(args, kwargs, 0, "length", 1)), 0), 0, 1)
    return None


def _text_method_cost(text: str | bytes, name: str, args: tuple, kwargs: dict, cap: int) -> Cost | None:
    size, chars = len(text), 1 if isinstance(text, bytes) else width(text)
    if name in ("capitalize", "casefold", "lower", "swapcase", "title", "upper"):
        return Cost(size * (1 if chars == 1 else CASE_GROWTH), 0, chars)
    if name in ("center", "ljust", "rjust", "zfill"):
        fill = _arg(args, kwargs, 1, "fillchar", "")
        return Cost(max(size, _int(_arg(args, kwargs, 0, "width"))), 0, width(text, fill) if chars == 1 else 4)
    if name == "expandtabs":
        tabs = text.count(b"\t" if isinstance(text, bytes) else "\t")
        return Cost(size + tabs * max(_int(_arg(args, kwargs, 0, "tabsize", 8)), 0), 0, chars)
    if name == "replace":
        old, new, count = _arg(args, kwargs, 0, "old"), _arg(args, kwargs, 1, "new"), _arg(args, kwargs, 2, "count")
        growth = max(len(new) - len(old), 0) if isinstance(new, (str, bytes)) and isinstance(old, (str, bytes)) else 0
        return Cost(size + _occurrences(text, old, count, size) * growth, 0, 4)
    if name == "translate":
        table = _arg(args, kwargs, 0, "table")
        values = table.values() if isinstance(table, dict) else table if isinstance(table, (list, tuple)) else ()
        longest = max((len(value) for value in values if isinstance(value, (str, bytes))), default=1)
        return Cost(size * max(longest, 1), 0, 4)
    if name in ("split", "rsplit", "splitlines", "partition", "rpartition"):
        return Cost(size, _parts(text, name, args, kwargs), chars)
    if name in ("strip", "lstrip", "rstrip", "removeprefix", "removesuffix"):
        return Cost(size, 0, chars)
    if name == "encode":  # 'xmlcharrefreplace' writes '&#1114111;' for one character
        return Cost(10 * size + 16, 0, 1)
    if name == "decode":  # 'backslashreplace' writes '\\xff' for one byte
        return Cost(4 * size + 16)
    if name == "hex":
        return Cost(3 * size + 2, 0, 1)
    if name == "maketrans":
        return Cost(0, sum(_sequence_length(arg) for arg in args))
    if name in _SMALL_TEXT_METHODS or name.startswith("is"):
        return Cost()
    return None


_SMALL_TEXT_METHODS = frozenset("count endswith find index rfind rindex startswith".split())


def _parts(text: str | bytes, name: str, args: tuple, kwargs: dict) -> int:
    """How many pieces split, rsplit, splitlines or partition make of text, at most."""
    if name in ("partition", "rpartition"):
        return 3
    if name == "splitlines":
        return line_count(text.decode("latin-1") if isinstance(text, bytes) else text)
    separator, most = _arg(args, kwargs, 0, "sep"), _arg(args, kwargs, 1, "maxsplit", -1)
    pieces = text.count(separator) + 1 if type(separator) is type(text) and separator else len(text) // 2 + 1
    return min(pieces, most + 1) if isinstance(most, int) and most >= 0 else pieces
