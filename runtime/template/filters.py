"""The filters, tests and globals a chat template is given, each bounded: what it will build is
measured (costs.py) and admitted to the render's budget (limits.py) before it runs. join and sum are
jinja's, rewritten to measure their items; str.format's fields are measured one by one; namespace() and
dict() count their entries and refuse underscore names.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from itertools import chain
from typing import Any

from jinja2.exceptions import SecurityError
from jinja2.filters import make_attrgetter, sync_do_join
from jinja2.sandbox import SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, pass_environment, pass_eval_context
from markupsafe import Markup

from ..errors import ChatTemplateError
from .costs import filter_cost, result_cost, text_cost, texts_cost
from .limits import MAX_OUTPUT_CHARS, check_arguments, check_length, checked, current_budget, materialized
from .sizes import ESCAPE_GROWTH, Cost, converted_size, format_spec_extra, text_size


@pass_eval_context
def finalize(eval_ctx: Any, value: Any) -> Any:
    # Called on every {{ expression }} before it is printed, also inside macros and loops.
    cost = text_cost(value)
    if eval_ctx.autoescape and not isinstance(value, Markup):
        cost = cost._replace(chars=cost.chars * ESCAPE_GROWTH)
    current_budget().build(cost)
    return value


def counted_loop(iterable: Any, literal_chars: int, char_width: int) -> Any:
    budget, literal = current_budget(), Cost(literal_chars, 0, char_width)
    for item in iterable:
        budget.step()
        budget.build(literal)  # the loop body's fixed text, printed once per iteration
        yield item


def counted_spread(value: Any) -> Any:
    # f(*text) makes a tuple of one string per character before any hook sees the call: count them first.
    if hasattr(value, "__len__"):
        current_budget().build(Cost(0, len(value)))
        return value
    return materialized(value)


def bounded_filter(name: str, func: Any) -> Any:
    value_at = 1 if hasattr(func, "jinja_pass_arg") else 0  # after the context jinja passes first, if it does
    consumes_all = name in ("join", "list", "sum", "sort", "unique", "dictsort", "groupby", "batch", "slice", "reverse")

    @functools.wraps(func)  # keeps jinja_pass_arg, so jinja still passes the context
    def bounded(*args: Any, **kwargs: Any) -> Any:
        check_arguments(args[value_at + 1 :], kwargs)
        if consumes_all:
            args = (*args[:value_at], materialized(args[value_at]), *args[value_at + 1 :])
        budget = current_budget()
        cost = filter_cost(name, args[value_at], args[value_at + 1 :], kwargs, MAX_OUTPUT_CHARS)
        if cost is not None:
            if value_at and getattr(args[0], "autoescape", False):  # an eval context that escapes
                cost = cost._replace(chars=cost.chars * ESCAPE_GROWTH)
            budget.build(cost)
        result = func(*args, **kwargs)
        if cost is None:
            budget.build(result_cost(result))
        return checked(result)

    return bounded


def bounded_text_test(func: Any) -> Any:
    @functools.wraps(func)
    def bounded(value: Any, *args: Any) -> Any:
        current_budget().build(text_cost(value))  # the lower and upper tests call str(value)
        return func(value, *args)

    return bounded


@pass_eval_context
def bounded_join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    """jinja's join, measuring the items (after `attribute` picks from them) before joining them."""
    items = materialized(value)
    if attribute is not None:
        items = list(map(make_attrgetter(eval_ctx.environment, attribute), items))
    cost = texts_cost(items)
    separator = text_size(d, MAX_OUTPUT_CHARS) * max(len(items) - 1, 0)
    growth = ESCAPE_GROWTH if eval_ctx.autoescape else 1
    current_budget().build(Cost((cost.chars + separator) * growth, len(items), 4))
    return sync_do_join(eval_ctx, items, d)


@pass_environment
def bounded_sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja's sum; lists (or tuples) are chained in one pass instead of copied once per item."""
    items = materialized(iterable)
    if attribute is not None:
        items = list(map(make_attrgetter(environment, attribute), items))
    if isinstance(start, (list, tuple)):
        for item in items:
            if type(item) is not type(start):
                raise TypeError(f'can only concatenate {type(start).__name__} (not "{type(item).__name__}")')
        current_budget().build(Cost(0, len(start) + sum(len(item) for item in items)))
        return type(start)(chain(start, *items))
    return sum(items, start)


def raise_exception(message: str) -> None:
    current_budget().build(text_cost(message))
    raise ChatTemplateError(str(message)[:1000])


def tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Hugging Face's tojson: no HTML escaping (jinja's own escapes <, >, &), with json.dumps' options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    if isinstance(format, str):
        current_budget().build(Cost(32 * len(format) + 64))  # '%c' is two characters of a 24-character date
    return datetime.now().strftime(format)


class BoundedNamespace(Namespace):
    """jinja's namespace(), refusing underscore names (a way at internals) and counting its entries."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        bounded_dict(*args[1:], **kwargs)  # counts the entries it copies
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            BoundedNamespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        BoundedNamespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with an underscore: {name!r}")


def bounded_dict(*args: Any, **kwargs: Any) -> dict:
    # The builtin type would let templates reach dict.mro(); the entries are counted before they are copied.
    current_budget().build(Cost(0, sum(len(arg) for arg in args if hasattr(arg, "__len__")) + len(kwargs)))
    return dict(*args, **kwargs)


class _BoundedFields:
    """str.format's fields, each measured before it is converted and formatted (widths come from the spec)."""

    _chars = 0
    _growth = 1

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._chars = len(format_string)  # the literal text, copied once
        current_budget().build(Cost(len(format_string)))
        return super().vformat(format_string, args, kwargs)  # type: ignore[misc]

    def convert_field(self, value: Any, conversion: str | None) -> Any:
        if conversion is not None:
            self._grow(converted_size(value, conversion, MAX_OUTPUT_CHARS))
        return super().convert_field(value, conversion)  # type: ignore[misc]

    def format_field(self, value: Any, format_spec: str) -> Any:
        self._grow(converted_size(value, "", MAX_OUTPUT_CHARS) + format_spec_extra(format_spec))
        return super().format_field(value, format_spec)  # type: ignore[misc]

    def _grow(self, size: int) -> None:
        self._chars += size * self._growth
        check_length(self._chars)
        current_budget().build(Cost(size * self._growth))


class BoundedFormatter(_BoundedFields, SandboxedFormatter):
    pass


class BoundedEscapeFormatter(_BoundedFields, SandboxedEscapeFormatter):
    _growth = ESCAPE_GROWTH  # Markup.format escapes every field
