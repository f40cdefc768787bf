"""A bounded jinja2 sandbox for chat templates, which are untrusted code from a checkpoint.

jinja2's ImmutableSandboxedEnvironment refuses Python internals (`__class__`, `__globals__`, ...) and
mutating the data it is given. On top of it every render is bounded: loop iterations plus calls, call
depth, the size of values built by operators, calls and filters, the text produced, and wall time. The
bounds stop runaway templates (endless loops, runaway recursion, gigabytes of output) with a
ChatTemplateError; they are a guard, not a proof. The globals and filters are the ones Hugging Face's
`apply_chat_template` gives a template (raise_exception, tojson, strftime_now, loop controls).
"""

from __future__ import annotations

import functools
import json
import time
from contextvars import ContextVar
from datetime import datetime
from typing import Any

from jinja2 import Template, nodes
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from jinja2.utils import Namespace

from .errors import ChatTemplateError

MAX_SOURCE_CHARS = 1_000_000  # a template's source; real ones are a few kB
MAX_OUTPUT_CHARS = 4_000_000  # the rendered prompt, and any one string or list a template builds
MAX_PRODUCED_CHARS = 8 * MAX_OUTPUT_CHARS  # text produced inside a render, counting macro and loop output
MAX_STEPS = 200_000  # loop iterations plus calls in one render; a 1000-message chat takes ~10k
MAX_DEPTH = 64  # nested calls, i.e. macro recursion
MAX_SECONDS = 5.0  # wall time of one render
MAX_DATA_DEPTH = 32  # nesting of dicts and lists inside messages and variables

_LOOP_FILTER = "edgelm_counted_loop"  # wrapped around every for loop's iterable at compile time


class _LimitError(RuntimeError):
    """A render went past one of the bounds above."""


class _Budget:
    """What one render has spent; lives in a ContextVar so threads rendering one template don't share it."""

    def __init__(self) -> None:
        self.steps = 0
        self.depth = 0
        self.produced = 0
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _LimitError(f"more than {MAX_STEPS:,} loop iterations and calls (an endless loop?)")
        if time.monotonic() > self.deadline:
            raise _LimitError(f"rendering took more than {MAX_SECONDS} s")

    def produce(self, chars: int) -> None:
        self.produced += chars
        if self.produced > MAX_PRODUCED_CHARS:
            raise _LimitError(f"the template produced more than {MAX_PRODUCED_CHARS:,} characters")


_BUDGET: ContextVar[_Budget | None] = ContextVar("edgelm_chat_template_budget", default=None)


def _budget() -> _Budget:
    # Outside a render (jinja folds constants at compile time) a fresh budget still applies the size checks.
    return _BUDGET.get() or _Budget()


def _check_length(length: int) -> None:
    if length > MAX_OUTPUT_CHARS:
        raise _LimitError(f"a value of {length:,} items or characters (the limit is {MAX_OUTPUT_CHARS:,})")


def _checked(value: Any) -> Any:
    if isinstance(value, (str, list, tuple, dict)):
        _check_length(len(value))
    return value


def _check_size(value: Any) -> None:
    _checked(value)
    if isinstance(value, (list, tuple, dict)):  # join, tojson, ... of a list of large strings
        _check_length(_text_size(value))


def _check_arguments(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        # Widths and counts (center, ljust, indent, tojson's indent, ...) would allocate before any result check.
        if type(value) is int and abs(value) > MAX_OUTPUT_CHARS:
            raise _LimitError(f"an argument of {value:,} (the limit is {MAX_OUTPUT_CHARS:,})")
        _check_size(value)


def _text_size(value: Any) -> int:
    """About how many characters str(value) has, walking no further than the output limit."""
    total, stack = 0, [value]
    while stack and total <= MAX_OUTPUT_CHARS:
        item = stack.pop()
        if isinstance(item, str):
            total += len(item) + 2
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
            total += 2
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
            total += 2
        else:
            total += 8
    return total


def _finalize(value: Any) -> Any:
    # Called on every {{ expression }} before it is printed, also inside macros and loops.
    _budget().produce(len(value) if isinstance(value, str) else _text_size(value))
    return value


def _counted_loop(iterable: Any, literal_chars: int) -> Any:
    budget = _budget()
    for item in iterable:
        budget.step()
        budget.produce(literal_chars)  # the loop body's fixed text, printed once per iteration
        yield item


def _bounded_filter(func: Any) -> Any:
    value_at = 1 if hasattr(func, "jinja_pass_arg") else 0  # after the context jinja passes first, if it does

    @functools.wraps(func)  # keeps jinja_pass_arg, so jinja still passes the context
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_size(args[value_at])  # the value filtered may be a large number: {{ n|int }}
        _check_arguments(args[value_at + 1 :], kwargs)
        return _checked(func(*args, **kwargs))

    return bounded


def raise_exception(message: str) -> None:
    raise ChatTemplateError(str(message))


def tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Hugging Face's tojson: no HTML escaping (jinja's own escapes <, >, &), with json.dumps' options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    return datetime.now().strftime(format)


class _Namespace(Namespace):
    """jinja's namespace(), refusing underscore names (a way at internals) and oversized values."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        Namespace.__init__(self, {name: _checked(value) for name, value in attrs.items()})

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        Namespace.__setitem__(self, name, _checked(value))

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with an underscore: {name!r}")


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, with every call and the size-changing operators counted and checked."""

    intercepted_binops = frozenset({"*", "**", "+"})

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.step()
        _check_arguments(args, kwargs)
        budget.depth += 1
        try:
            if budget.depth > MAX_DEPTH:
                raise _LimitError(f"calls nested more than {MAX_DEPTH} deep (runaway recursion?)")
            if getattr(__obj, "__name__", "") == "join" and isinstance(getattr(__obj, "__self__", None), str) and args:
                _check_length(len(__obj.__self__) * len(args[0]) if hasattr(args[0], "__len__") else 0)
            result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        if isinstance(__obj, Macro):
            budget.produce(len(result))
        return _checked(result)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        _budget().step()
        if operator == "*":
            for sequence, count in ((left, right), (right, left)):
                if isinstance(sequence, (str, list, tuple)) and type(count) is int:
                    _check_length(len(sequence) * count)
        if operator == "**" and type(left) is int and type(right) is int and right > 0:
            if left.bit_length() * right > 4096:  # 10**1233 is still fine; 10**10**10 would hang
                raise _LimitError(f"{left} ** {right} is too large a number")
        return _checked(super().call_binop(context, operator, left, right))

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja returns an Undefined that fails only when used; printing it would quietly give ''.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed")


def _environment() -> _Environment:
    # A fresh environment per template: compiled templates keep a reference to theirs.
    env = _Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"], finalize=_finalize)
    env.filters["tojson"] = tojson
    env.filters = {name: _bounded_filter(func) for name, func in env.filters.items()}
    env.filters[_LOOP_FILTER] = _counted_loop
    del env.globals["lipsum"]  # random text of any length; no chat template uses it
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=_Namespace, dict=_dict)
    return env


def _dict(*args: Any, **kwargs: Any) -> dict:
    return dict(*args, **kwargs)  # the builtin type would let templates reach dict.mro()


def _literal_chars(loop: nodes.For) -> int:
    body = [node for child in loop.body for node in (child, *child.find_all((nodes.TemplateData, nodes.Const)))]
    return (
        1
        + sum(len(node.data) for node in body if isinstance(node, nodes.TemplateData))
        + sum(len(node.value) for node in body if isinstance(node, nodes.Const) and isinstance(node.value, str))
    )


def compile_template(source: str) -> Template:
    """Compile a chat template in the bounded sandbox; ChatTemplateError names the line that does not parse."""
    if not isinstance(source, str) or not source.strip():
        raise ChatTemplateError("a chat template must be a non-empty string")
    if len(source) > MAX_SOURCE_CHARS:
        raise ChatTemplateError(f"a chat template of {len(source):,} characters (the limit is {MAX_SOURCE_CHARS:,})")
    env = _environment()
    try:
        tree = env.parse(source)
        for loop in list(tree.find_all(nodes.For)):  # count every iteration against the render's budget
            weight = nodes.Const(_literal_chars(loop))
            loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, [weight], [], None, None, lineno=loop.lineno)
        return env.from_string(tree)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc
    except RecursionError as exc:
        raise ChatTemplateError("chat template does not compile: nested too deeply") from exc


def render_bounded(template: Template, context: dict[str, Any]) -> str:
    """Render within the bounds above; any failure of the template becomes one ChatTemplateError line."""
    token = _BUDGET.set(_Budget())
    stream = template.generate(context)
    parts, size = [], 0
    try:
        for chunk in stream:
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise _LimitError(f"the rendered prompt passed {MAX_OUTPUT_CHARS:,} characters")
            parts.append(chunk)
    except ChatTemplateError:
        raise  # raise_exception: the template's own message
    except Exception as exc:  # untrusted code can fail in any way; the caller gets one clear error
        raise ChatTemplateError(_describe(exc)) from exc
    finally:
        stream.close()
        _BUDGET.reset(token)
    return "".join(parts)


def _template_line(exc: BaseException) -> int | None:
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":  # jinja rewrites tracebacks to template lines
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _describe(exc: BaseException) -> str:
    line = _template_line(exc)
    where = f" at line {line}" if line is not None else ""
    if isinstance(exc, SecurityError):
        what = f"refused by the sandbox: {exc}"
    elif isinstance(exc, _LimitError):
        what = f"stopped: {exc}"
    elif isinstance(exc, RecursionError):
        what = "recursion too deep"
    else:
        what = f"{type(exc).__name__}: {exc}".rstrip(": ")
    return f"chat template failed{where}: {' '.join(what.split())[:500]}"
