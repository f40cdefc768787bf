"""A bounded jinja2 sandbox for chat templates, which are untrusted code from a checkpoint.

jinja2's ImmutableSandboxedEnvironment refuses Python internals (`__class__`, `__globals__`, ...) and
mutating the data it is given. On top of it every render is bounded: loop iterations plus calls, call
depth, the size of each value and of everything the render builds, the text produced, and wall time.
Sizes are checked BEFORE an operation allocates: each filter, string method, operator (`+`, `*`, `%`,
`**`), str.format field, concatenation (`~`) and slice is first measured with template_sizes.py's
upper bounds from its inputs, so `'%999999999s' % 1` or `x|indent(10**8)` fails without building a
gigabyte. Nothing is evaluated while compiling: jinja's constant folding (which would run `'%s' % ...`
even inside `{% if false %}`) is off, and the source and the Python it compiles to are bounded. Text
is only made of data: a function, macro, cycler or namespace cannot be printed (its repr shows a heap
address). The bounds stop runaway templates with a ChatTemplateError; they are a guard, not a proof.
The globals and filters are the ones Hugging Face's `apply_chat_template` gives a template
(raise_exception, tojson, strftime_now, loop controls) less pprint, urlize and wordwrap, whose cost the
input size does not bound and which no chat template uses.
"""

from __future__ import annotations

import functools
import json
import re
import time
import types
from collections.abc import Iterable
from contextvars import ContextVar
from datetime import datetime
from itertools import chain
from typing import Any

from jinja2 import Template, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.filters import make_attrgetter, sync_do_join
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment, SandboxedEscapeFormatter, SandboxedFormatter
from jinja2.utils import Namespace, pass_environment, pass_eval_context
from markupsafe import Markup

from .errors import ChatTemplateError
from .template_sizes import (
    ESCAPE_GROWTH,
    Cost,
    converted_size,
    filter_cost,
    format_spec_extra,
    method_cost,
    percent_size,
    text_size,
    width,
)

MAX_SOURCE_CHARS = 100_000  # a template's source; real ones are 0.5-17 kB
MAX_NODES = 20_000  # parsed template nodes; real templates have up to about 1,000
MAX_CODE_CHARS = 300_000  # the Python a template compiles to (compiling takes ~125 bytes per character)
MAX_OUTPUT_CHARS = 4_000_000  # the rendered prompt, and any one string or list a template builds
MAX_BUILT_BYTES = 48 << 20  # everything one render builds: every string, list and printed value, freed or not
MAX_STEPS = 200_000  # loop iterations plus calls in one render; a 1000-message chat takes ~10k
MAX_DEPTH = 64  # nested calls, i.e. macro recursion
MAX_SECONDS = 5.0  # wall time of one render
MAX_DATA_DEPTH = 32  # nesting of dicts and lists inside messages and variables
MAX_INT_BITS = 16_384  # a number built by * or **; 10 ** 4000 is still fine

_LOOP_FILTER = "edgelm_counted_loop"  # wrapped around every for loop's iterable at compile time
_SPREAD_FILTER = "edgelm_counted_spread"  # wrapped around every *args and **kwargs of a call at compile time
_REMOVED_FILTERS = ("pprint", "urlize", "wordwrap")
_ONE_ITEM = Cost(0, 1)


class _LimitError(RuntimeError):
    """A render went past one of the bounds above."""


class _Budget:
    """What one render has spent; lives in a ContextVar so threads rendering one template don't share it."""

    def __init__(self) -> None:
        self.steps = 0
        self.depth = 0
        self.built = 0  # bytes, as template_sizes.Cost counts them
        self.deadline = time.monotonic() + MAX_SECONDS

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise _LimitError(f"more than {MAX_STEPS:,} loop iterations and calls (an endless loop?)")
        if time.monotonic() > self.deadline:
            raise _LimitError(f"rendering took more than {MAX_SECONDS} s")

    def build(self, cost: Cost) -> None:
        """Admit what an operation is about to build, or refuse it before it allocates."""
        _check_length(max(cost.chars, cost.items))
        self.built += cost.bytes
        if self.built > MAX_BUILT_BYTES:
            raise _LimitError(f"the template built more than {MAX_BUILT_BYTES >> 20} MiB of text and lists")


_BUDGET: ContextVar[_Budget | None] = ContextVar("edgelm_chat_template_budget", default=None)


def _budget() -> _Budget:
    # Outside a render (a test calling a filter directly) a fresh budget still applies the size checks.
    return _BUDGET.get() or _Budget()


def _check_length(length: int) -> None:
    if length > MAX_OUTPUT_CHARS:
        raise _LimitError(f"a value of {length:,} items or characters (the limit is {MAX_OUTPUT_CHARS:,})")


def _checked(value: Any) -> Any:
    if isinstance(value, (str, bytes, list, tuple, dict)):
        _check_length(len(value))
    return value


def _check_arguments(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        # Widths and counts of callables no bound knows (and a second guard for those it does).
        if type(value) is int and abs(value) > MAX_OUTPUT_CHARS:
            raise _LimitError(f"an argument of {value:,} (the limit is {MAX_OUTPUT_CHARS:,})")


def _result_cost(value: Any) -> Cost:
    """What an operation no bound knows did build, counted after the fact."""
    if isinstance(value, str):
        return Cost(len(value), 0, width(value))
    if isinstance(value, bytes):
        return Cost(len(value), 0, 1)
    return Cost(0, len(value)) if isinstance(value, (list, tuple, dict)) else Cost()


def _text_cost(*values: Any) -> Cost:
    """Turning values into one text, as `~`, print and str() do; refuses what is not data."""
    return _texts_cost(values)


def _texts_cost(values: Iterable) -> Cost:
    size, markup, narrow = 0, False, True
    for value in values:
        size += text_size(value, MAX_OUTPUT_CHARS)
        if size > MAX_OUTPUT_CHARS:
            break  # refused: no need to read the rest
        markup = markup or isinstance(value, Markup)
        narrow = narrow and isinstance(value, str) and value.isascii()
    return Cost(size * (ESCAPE_GROWTH if markup else 1), 0, 1 if narrow else 4)  # Markup escapes what it joins


def _materialized(value: Any) -> Any:
    """value, or the items of an iterator in a list, each counted as it arrives (a filter will keep them)."""
    if isinstance(value, (str, bytes, list, tuple, dict, range)) or not hasattr(value, "__next__"):
        return value
    budget, items = _budget(), []
    for item in value:
        budget.build(_ONE_ITEM)
        items.append(item)
        _check_length(len(items))
    return items


@pass_eval_context
def _finalize(eval_ctx: Any, value: Any) -> Any:
    # Called on every {{ expression }} before it is printed, also inside macros and loops.
    cost = _text_cost(value)
    if eval_ctx.autoescape and not isinstance(value, Markup):
        cost = cost._replace(chars=cost.chars * ESCAPE_GROWTH)
    _budget().build(cost)
    return value


def _counted_loop(iterable: Any, literal_chars: int, char_width: int) -> Any:
    budget, literal = _budget(), Cost(literal_chars, 0, char_width)
    for item in iterable:
        budget.step()
        budget.build(literal)  # the loop body's fixed text, printed once per iteration
        yield item


def _counted_spread(value: Any) -> Any:
    # f(*text) makes a tuple of one string per character before any hook sees the call: count them first.
    if hasattr(value, "__len__"):
        _budget().build(Cost(0, len(value)))
        return value
    return _materialized(value)


def _bounded_filter(name: str, func: Any) -> Any:
    value_at = 1 if hasattr(func, "jinja_pass_arg") else 0  # after the context jinja passes first, if it does
    consumes_all = name in ("join", "list", "sum", "sort", "unique", "dictsort", "groupby", "batch", "slice", "reverse")

    @functools.wraps(func)  # keeps jinja_pass_arg, so jinja still passes the context
    def bounded(*args: Any, **kwargs: Any) -> Any:
        _check_arguments(args[value_at + 1 :], kwargs)
        if consumes_all:
            args = (*args[:value_at], _materialized(args[value_at]), *args[value_at + 1 :])
        budget = _budget()
        cost = filter_cost(name, args[value_at], args[value_at + 1 :], kwargs, MAX_OUTPUT_CHARS)
        if cost is not None:
            if value_at and getattr(args[0], "autoescape", False):  # an eval context that escapes
                cost = cost._replace(chars=cost.chars * ESCAPE_GROWTH)
            budget.build(cost)
        result = func(*args, **kwargs)
        if cost is None:
            budget.build(_result_cost(result))
        return _checked(result)

    return bounded


def _bounded_text_test(func: Any) -> Any:
    @functools.wraps(func)
    def bounded(value: Any, *args: Any) -> Any:
        _budget().build(_text_cost(value))  # the lower and upper tests call str(value)
        return func(value, *args)

    return bounded


@pass_eval_context
def _join(eval_ctx: Any, value: Any, d: str = "", attribute: Any = None) -> str:
    """jinja's join, measuring the items (after `attribute` picks from them) before joining them."""
    items = _materialized(value)
    if attribute is not None:
        items = list(map(make_attrgetter(eval_ctx.environment, attribute), items))
    cost = _texts_cost(items)
    separator = text_size(d, MAX_OUTPUT_CHARS) * max(len(items) - 1, 0)
    growth = ESCAPE_GROWTH if eval_ctx.autoescape else 1
    _budget().build(Cost((cost.chars + separator) * growth, len(items), 4))
    return sync_do_join(eval_ctx, items, d)


@pass_environment
def _sum(environment: Any, iterable: Any, attribute: Any = None, start: Any = 0) -> Any:
    """jinja's sum; lists (or tuples) are chained in one pass instead of copied once per item."""
    items = _materialized(iterable)
    if attribute is not None:
        items = list(map(make_attrgetter(environment, attribute), items))
    if isinstance(start, (list, tuple)):
        for item in items:
            if type(item) is not type(start):
                raise TypeError(f'can only concatenate {type(start).__name__} (not "{type(item).__name__}")')
        _budget().build(Cost(0, len(start) + sum(len(item) for item in items)))
        return type(start)(chain(start, *items))
    return sum(items, start)


def raise_exception(message: str) -> None:
    _budget().build(_text_cost(message))
    raise ChatTemplateError(str(message)[:1000])


def tojson(
    value: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False
) -> str:
    # Hugging Face's tojson: no HTML escaping (jinja's own escapes <, >, &), with json.dumps' options.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def strftime_now(format: str) -> str:
    if isinstance(format, str):
        _budget().build(Cost(32 * len(format) + 64))  # '%c' is two characters of a 24-character date
    return datetime.now().strftime(format)


class _Namespace(Namespace):
    """jinja's namespace(), refusing underscore names (a way at internals) and counting its entries."""

    def __init__(*args: Any, **kwargs: Any) -> None:
        _dict(*args[1:], **kwargs)  # counts the entries it copies
        self, attrs = args[0], dict(*args[1:], **kwargs)
        for name in attrs:
            _Namespace._check_name(name)
        Namespace.__init__(self, attrs)

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check_name(name)
        Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check_name(name: Any) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise SecurityError(f"a namespace attribute may not start with an underscore: {name!r}")


def _dict(*args: Any, **kwargs: Any) -> dict:
    # The builtin type would let templates reach dict.mro(); the entries are counted before they are copied.
    _budget().build(Cost(0, sum(len(arg) for arg in args if hasattr(arg, "__len__")) + len(kwargs)))
    return dict(*args, **kwargs)


class _BoundedFields:
    """str.format's fields, each measured before it is converted and formatted (widths come from the spec)."""

    _chars = 0
    _growth = 1

    def vformat(self, format_string: str, args: Any, kwargs: Any) -> str:
        self._chars = len(format_string)  # the literal text, copied once
        _budget().build(Cost(len(format_string)))
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
        _check_length(self._chars)
        _budget().build(Cost(size * self._growth))


class _Formatter(_BoundedFields, SandboxedFormatter):
    pass


class _EscapingFormatter(_BoundedFields, SandboxedEscapeFormatter):
    _growth = ESCAPE_GROWTH  # Markup.format escapes every field


class _CodeGenerator(CodeGenerator):
    """jinja's code generator, with `~` and slices routed through the environment so they are measured,
    and `{% autoescape %}` taking literals only (jinja would evaluate any other expression while compiling)."""

    def visit_Concat(self, node: nodes.Concat, frame: Frame) -> None:
        if frame.eval_ctx.volatile:  # the same join jinja picks
            join = "(markup_join if context.eval_ctx.volatile else str_join)"
        else:
            join = "markup_join" if frame.eval_ctx.autoescape else "str_join"
        self.write(f"{join}(environment.concat_pieces((")
        for piece in node.nodes:
            self.visit(piece, frame)
            self.write(", ")
        self.write(")))")

    def visit_Getitem(self, node: nodes.Getitem, frame: Frame) -> None:
        if not isinstance(node.arg, nodes.Slice):
            super().visit_Getitem(node, frame)
            return
        self.write("environment.getitem(")
        self.visit(node.node, frame)
        self.write(", slice(")
        for part in (node.arg.start, node.arg.stop, node.arg.step):
            if part is None:
                self.write("None")
            else:
                self.visit(part, frame)
            self.write(", ")
        self.write("))")

    def visit_EvalContextModifier(self, node: nodes.EvalContextModifier, frame: Frame) -> None:
        for keyword in node.options:
            self.writeline(f"context.eval_ctx.{keyword.key} = ")
            self.visit(keyword.value, frame)
            if isinstance(keyword.value, nodes.Const):
                setattr(frame.eval_ctx, keyword.key, keyword.value.value)
            else:
                frame.eval_ctx.volatile = True


class _Environment(ImmutableSandboxedEnvironment):
    """The sandbox, with every call and the size-changing operators counted and measured first."""

    code_generator_class = _CodeGenerator
    intercepted_binops = frozenset({"*", "**", "+", "%"})  # intercepted operators are also never folded

    def call(__self, __context: Any, __obj: Any, *args: Any, **kwargs: Any) -> Any:  # noqa: N805
        budget = _budget()
        budget.step()
        _check_arguments(args, kwargs)
        receiver, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", None)
        if name == "join" and isinstance(receiver, (str, bytes)) and len(args) == 1 and not kwargs:
            args = (_materialized(args[0]),)  # measured once its items are in a list
            items = args[0] if hasattr(args[0], "__len__") else ()
            joined = _texts_cost(items)
            cost = Cost(joined.chars + len(receiver) * max(len(items) - 1, 0), len(items), joined.width)
        else:
            cost = method_cost(receiver, name, args, kwargs, MAX_OUTPUT_CHARS) if isinstance(name, str) else None
        if cost is not None:
            budget.build(cost)
        budget.depth += 1
        try:
            if budget.depth > MAX_DEPTH:
                raise _LimitError(f"calls nested more than {MAX_DEPTH} deep (runaway recursion?)")
            result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        if isinstance(__obj, Macro) or cost is None:
            budget.build(_result_cost(result))  # a macro's output, or what an unmeasured callable built
        return _checked(result)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = _budget()
        budget.step()
        budget.build(_binop_cost(operator, left, right))
        return _checked(super().call_binop(context, operator, left, right))

    def getitem(self, obj: Any, argument: Any) -> Any:
        if not isinstance(argument, slice):
            return super().getitem(obj, argument)
        if isinstance(obj, (str, bytes, list, tuple)):
            count = len(range(*argument.indices(len(obj))))
            _budget().build(Cost(count, 0, width(obj)) if isinstance(obj, (str, bytes)) else Cost(0, count))
        return obj[argument]  # as jinja does for a slice: no fallback to an attribute

    def concat_pieces(self, pieces: tuple) -> tuple:
        """The pieces of `a ~ b ~ ...`, admitted before they are joined."""
        _budget().build(_text_cost(*pieces))
        return pieces

    def wrap_str_format(self, value: Any) -> Any:
        """str.format and format_map of a text, with every field measured first (see _BoundedFields)."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)):
            return None
        text = getattr(value, "__self__", None)
        if value.__name__ not in ("format", "format_map") or not isinstance(text, str):
            return None
        formatter = _EscapingFormatter(self, escape=text.escape) if isinstance(text, Markup) else _Formatter(self)
        is_map = value.__name__ == "format_map"

        def bounded_format(*args: Any, **kwargs: Any) -> str:
            if is_map:
                if kwargs or len(args) != 1:
                    raise TypeError("format_map() takes exactly one argument")
                args, kwargs = (), args[0]
            return type(text)(formatter.vformat(text, args, kwargs))

        return functools.update_wrapper(bounded_format, value)

    def unsafe_undefined(self, obj: Any, attribute: str) -> Any:
        # jinja returns an Undefined that fails only when used; printing it would quietly give ''.
        raise SecurityError(f"access to attribute {attribute!r} of a {type(obj).__name__} object is not allowed")

    def _compile(self, source: str, filename: str) -> Any:
        if len(source) > MAX_CODE_CHARS:
            raise _LimitError(f"it compiles to {len(source):,} characters of Python (the limit is {MAX_CODE_CHARS:,})")
        return super()._compile(source, filename)


def _binop_cost(operator: str, left: Any, right: Any) -> Cost:
    """What `left operator right` builds; ints that would pass MAX_INT_BITS are refused here."""
    if operator == "+":
        if isinstance(left, (str, bytes)) and isinstance(right, (str, bytes)):
            return _text_cost(left, right)
        if isinstance(left, (list, tuple)) and isinstance(right, (list, tuple)):
            return Cost(0, len(left) + len(right))
    elif operator == "*":
        for sequence, count in ((left, right), (right, left)):
            if isinstance(sequence, (str, bytes, list, tuple)) and isinstance(count, int):
                size = len(sequence) * max(count, 0)
                return Cost(size, 0, width(sequence)) if isinstance(sequence, (str, bytes)) else Cost(0, size)
        if isinstance(left, int) and isinstance(right, int) and left.bit_length() + right.bit_length() > MAX_INT_BITS:
            raise _LimitError(f"a product of more than {MAX_INT_BITS:,} bits")
    elif operator == "**":
        if isinstance(left, int) and isinstance(right, int) and right > 0 and abs(left) > 1:
            if left.bit_length() * right > MAX_INT_BITS:  # 10 ** 10 ** 10 would take hours
                raise _LimitError(f"{left} ** {right} is too large a number")
    elif operator == "%" and isinstance(left, (str, bytes)):
        size = percent_size(left, right, MAX_OUTPUT_CHARS)
        return Cost(size * (ESCAPE_GROWTH if isinstance(left, Markup) else 1))
    return Cost()


def _environment() -> _Environment:
    # A fresh environment per template: compiled templates keep a reference to theirs.
    env = _Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols"],
        finalize=_finalize,
        optimized=False,  # jinja's optimizer folds constants while compiling, before any bound applies
    )
    for name in _REMOVED_FILTERS:
        del env.filters[name]
    env.filters.update(tojson=tojson, join=_join, sum=_sum)
    env.filters = {name: _bounded_filter(name, func) for name, func in env.filters.items()}
    env.filters.update({_LOOP_FILTER: _counted_loop, _SPREAD_FILTER: _counted_spread})
    for name in ("lower", "upper"):
        env.tests[name] = _bounded_text_test(env.tests[name])
    del env.globals["lipsum"]  # random text of any length; no chat template uses it
    env.globals.update(raise_exception=raise_exception, strftime_now=strftime_now, namespace=_Namespace, dict=_dict)
    return env


def _literal_cost(loop: nodes.For) -> Cost:
    body = [node for child in loop.body for node in (child, *child.find_all((nodes.TemplateData, nodes.Const)))]
    texts = [node.data for node in body if isinstance(node, nodes.TemplateData)]
    texts += [node.value for node in body if isinstance(node, nodes.Const) and isinstance(node.value, str)]
    return Cost(1 + sum(map(len, texts)), 0, width(*texts))


def compile_template(source: str) -> Template:
    """Compile a chat template in the bounded sandbox; ChatTemplateError names the line that does not parse."""
    if not isinstance(source, str) or not source.strip():
        raise ChatTemplateError("a chat template must be a non-empty string")
    if len(source) > MAX_SOURCE_CHARS:
        raise ChatTemplateError(f"a chat template of {len(source):,} characters (the limit is {MAX_SOURCE_CHARS:,})")
    env = _environment()
    try:
        tree = env.parse(source)
        count = sum(1 for _ in tree.find_all(nodes.Node))
        if count > MAX_NODES:
            raise ChatTemplateError(f"a chat template of {count:,} parts (the limit is {MAX_NODES:,})")
        for loop in list(tree.find_all(nodes.For)):  # count every iteration against the render's budget
            weight = [nodes.Const(value) for value in _literal_cost(loop)[::2]]  # chars, width
            loop.iter = nodes.Filter(loop.iter, _LOOP_FILTER, weight, [], None, None, lineno=loop.lineno)
        for call in list(tree.find_all((nodes.Call, nodes.Filter, nodes.Test))):
            for field in ("dyn_args", "dyn_kwargs"):
                if getattr(call, field) is not None:
                    spread = nodes.Filter(getattr(call, field), _SPREAD_FILTER, [], [], None, None, lineno=call.lineno)
                    setattr(call, field, spread)
        return env.from_string(tree)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc
    except RecursionError as exc:
        raise ChatTemplateError("chat template does not compile: nested too deeply") from exc
    except (_LimitError, MemoryError) as exc:
        raise ChatTemplateError(f"chat template does not compile: {_what(exc)}") from exc


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
        return "".join(parts)
    except ChatTemplateError:
        raise  # raise_exception: the template's own message
    except Exception as exc:  # untrusted code can fail in any way, MemoryError too; the caller gets one clear error
        raise ChatTemplateError(_describe(exc)) from exc
    finally:
        stream.close()
        _BUDGET.reset(token)


def _template_line(exc: BaseException) -> int | None:
    line, tb = None, exc.__traceback__
    while tb is not None:
        if tb.tb_frame.f_code.co_filename == "<template>":  # jinja rewrites tracebacks to template lines
            line = tb.tb_lineno
        tb = tb.tb_next
    return line


def _what(exc: BaseException) -> str:
    if isinstance(exc, SecurityError):
        return f"refused by the sandbox: {exc}"
    if isinstance(exc, _LimitError):
        return f"stopped: {exc}"
    if isinstance(exc, RecursionError):
        return "recursion too deep"
    if isinstance(exc, MemoryError):
        return "stopped: out of memory"
    return f"{type(exc).__name__}: {exc}".rstrip(": ")


def _describe(exc: BaseException) -> str:
    line = _template_line(exc)
    where = f" at line {line}" if line is not None else ""
    what = re.sub(r" at 0x[0-9a-fA-F]+", "", _what(exc))  # a heap address in some object's repr
    return f"chat template failed{where}: {' '.join(what.split())[:500]}"
