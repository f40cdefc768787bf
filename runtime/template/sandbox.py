"""A bounded jinja2 sandbox for chat templates, which are untrusted code from a checkpoint.

jinja2's ImmutableSandboxedEnvironment refuses Python internals (`__class__`, `__globals__`, ...) and
mutating the data it is given. On top of it every render is bounded: loop iterations plus calls, call
depth, the size of each value and of everything the render builds, the text produced, and wall time.
Sizes are checked BEFORE an operation allocates: each filter, string method, operator (`+`, `*`, `%`,
`**`), str.format field, concatenation (`~`) and slice is first measured with costs.py's
upper bounds from its inputs, so `'%999999999s' % 1` or `x|indent(10**8)` fails without building a
gigabyte. Nothing is evaluated while compiling: jinja's constant folding (which would run `'%s' % ...`
even inside `{% if false %}`) is off, and the source and the Python it compiles to are bounded. Text
is only made of data: a function, macro, cycler or namespace cannot be printed (its repr shows a heap
address). The bounds stop runaway templates with a ChatTemplateError; they are a guard, not a proof.
The globals, filters and tags are the ones Hugging Face's `apply_chat_template` gives a template
(raise_exception, tojson, strftime_now, loop controls, `{% generation %}`) less pprint, urlize and
wordwrap, whose cost the input size does not bound and which no chat template uses.
The limits and the render's budget are in limits.py, what each operation builds in costs.py (from
sizes.py's bounds of values), the bounded filters and globals in filters.py; this module holds the
environment, compiling and rendering.
"""

from __future__ import annotations

import functools
import re
import types
from typing import Any

from jinja2 import Template, nodes
from jinja2.compiler import CodeGenerator, Frame
from jinja2.exceptions import SecurityError, TemplateSyntaxError
from jinja2.ext import Extension
from jinja2.parser import Parser
from jinja2.runtime import Macro
from jinja2.sandbox import ImmutableSandboxedEnvironment
from markupsafe import Markup

from ..errors import ChatTemplateError
from .costs import join_cost, method_cost, operator_cost, result_cost, text_cost
from .filters import (
    BoundedEscapeFormatter,
    BoundedFormatter,
    BoundedNamespace,
    bounded_dict,
    bounded_filter,
    bounded_join,
    bounded_sum,
    bounded_text_test,
    counted_loop,
    counted_spread,
    finalize,
    raise_exception,
    strftime_now,
    tojson,
)
from .limits import (
    BUDGET,
    MAX_CODE_CHARS,
    MAX_DEPTH,
    MAX_NODES,
    MAX_OUTPUT_CHARS,
    MAX_SOURCE_CHARS,
    Budget,
    LimitError,
    check_arguments,
    checked,
    current_budget,
    materialized,
)
from .sizes import Cost, width

__all__ = ["compile_template", "render_bounded"]

_LOOP_FILTER = "edgelm_counted_loop"  # wrapped around every for loop's iterable at compile time
_SPREAD_FILTER = "edgelm_counted_spread"  # wrapped around every *args and **kwargs of a call at compile time
_REMOVED_FILTERS = ("pprint", "urlize", "wordwrap")


class _CodeGenerator(CodeGenerator):
    """jinja's code generator, with `~`, slices and list, tuple and dict literals routed through the
    environment so they are measured, and `{% autoescape %}` taking literals only (jinja would evaluate any
    other expression while compiling)."""

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

    def visit_List(self, node: nodes.List, frame: Frame) -> None:
        self._measured(super().visit_List, node, frame)

    def visit_Tuple(self, node: nodes.Tuple, frame: Frame) -> None:
        if node.ctx != "load":  # `a, b` as a target of set or for
            super().visit_Tuple(node, frame)
        else:
            self._measured(super().visit_Tuple, node, frame)

    def visit_Dict(self, node: nodes.Dict, frame: Frame) -> None:
        self._measured(super().visit_Dict, node, frame)

    def _measured(self, visit: Any, node: nodes.Node, frame: Frame) -> None:
        """A literal list, tuple or dict measured as it is made: `[x, x]` doubles what a comparison walks."""
        self.write("environment.literal(")
        visit(node, frame)
        self.write(")")

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
        budget = current_budget()
        budget.step()
        check_arguments(args, kwargs)
        receiver, name = getattr(__obj, "__self__", None), getattr(__obj, "__name__", None)
        if name == "join" and isinstance(receiver, (str, bytes)) and len(args) == 1 and not kwargs:
            args = (materialized(args[0]),)  # measured once its items are in a list
            cost = join_cost(receiver, args[0])
        else:
            cost = method_cost(receiver, name, args, kwargs, MAX_OUTPUT_CHARS) if isinstance(name, str) else None
        if cost is not None:
            budget.build(cost)
        budget.depth += 1
        try:
            if budget.depth > MAX_DEPTH:
                raise LimitError(f"calls nested more than {MAX_DEPTH} deep (runaway recursion?)")
            result = ImmutableSandboxedEnvironment.call(__self, __context, __obj, *args, **kwargs)
        finally:
            budget.depth -= 1
        if isinstance(__obj, Macro) or cost is None:
            budget.build(result_cost(result))  # a macro's output, or what an unmeasured callable built
        return checked(result)

    def call_binop(self, context: Any, operator: str, left: Any, right: Any) -> Any:
        budget = current_budget()
        budget.step()
        budget.build(operator_cost(operator, left, right))
        return checked(super().call_binop(context, operator, left, right))

    def getitem(self, obj: Any, argument: Any) -> Any:
        if not isinstance(argument, slice):
            return super().getitem(obj, argument)
        if isinstance(obj, (str, bytes, list, tuple)):
            count = len(range(*argument.indices(len(obj))))
            current_budget().build(Cost(count, 0, width(obj)) if isinstance(obj, (str, bytes)) else Cost(0, count))
        return obj[argument]  # as jinja does for a slice: no fallback to an attribute

    def literal(self, value: Any) -> Any:
        """A list, tuple or dict literal, counted as built (it is kept until the render ends: see Budget.measure)."""
        current_budget().build(Cost(0, len(value)))
        return checked(value)

    def concat_pieces(self, pieces: tuple) -> tuple:
        """The pieces of `a ~ b ~ ...`, admitted before they are joined."""
        current_budget().build(text_cost(*pieces))
        return pieces

    def wrap_str_format(self, value: Any) -> Any:
        """str.format and format_map of a text, with every field measured first (see _BoundedFields)."""
        if not isinstance(value, (types.MethodType, types.BuiltinMethodType)):
            return None
        text = getattr(value, "__self__", None)
        if value.__name__ not in ("format", "format_map") or not isinstance(text, str):
            return None
        formatter = (
            BoundedEscapeFormatter(self, escape=text.escape) if isinstance(text, Markup) else BoundedFormatter(self)
        )
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
            raise LimitError(f"it compiles to {len(source):,} characters of Python (the limit is {MAX_CODE_CHARS:,})")
        return super()._compile(source, filename)


class _Generation(Extension):
    """transformers' `{% generation %}...{% endgeneration %}`, which marks the assistant's tokens for training
    masks: the body rendered as transformers renders it, a call block (so a `set` inside stays inside)."""

    tags = {"generation"}

    def parse(self, parser: Parser) -> nodes.CallBlock:
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
        return nodes.CallBlock(self.call_method("_body"), [], [], body).set_lineno(lineno)

    def _body(self, caller: Macro) -> str:
        return caller()


def _environment() -> _Environment:
    # A fresh environment per template: compiled templates keep a reference to theirs.
    env = _Environment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=["jinja2.ext.loopcontrols", _Generation],
        finalize=finalize,
        optimized=False,  # jinja's optimizer folds constants while compiling, before any bound applies
    )
    for name in _REMOVED_FILTERS:
        del env.filters[name]
    env.filters.update(tojson=tojson, join=bounded_join, sum=bounded_sum)
    env.filters = {name: bounded_filter(name, func) for name, func in env.filters.items()}
    env.filters.update({_LOOP_FILTER: counted_loop, _SPREAD_FILTER: counted_spread})
    for name in ("lower", "upper"):
        env.tests[name] = bounded_text_test(env.tests[name])
    del env.globals["lipsum"]  # random text of any length; no chat template uses it
    env.globals.update(
        raise_exception=raise_exception, strftime_now=strftime_now, namespace=BoundedNamespace, dict=bounded_dict
    )
    return env


def _literal_cost(loop: nodes.For) -> Cost:
    body = [node for child in loop.body for node in (child, *child.find_all((nodes.TemplateData, nodes.Const)))]
    texts = [node.data for node in body if isinstance(node, nodes.TemplateData)]
    texts += [node.value for node in body if isinstance(node, nodes.Const) and isinstance(node.value, str)]
    return Cost(1 + sum(map(len, texts)), 0, width(*texts))


def compile_template(source: str) -> tuple[Template, tuple[str, ...]]:
    """Compile a chat template in the bounded sandbox; ChatTemplateError names the line that does not parse.
    Returns the template and its literals: the text and the string constants written in it."""
    if not isinstance(source, str) or not source.strip():
        raise ChatTemplateError("a chat template must be a non-empty string")
    if len(source) > MAX_SOURCE_CHARS:
        raise ChatTemplateError(f"a chat template of {len(source):,} characters (the limit is {MAX_SOURCE_CHARS:,})")
    env = _environment()
    try:
        tree = env.parse(source)
        literals = [node.data for node in tree.find_all(nodes.TemplateData)]
        literals += [node.value for node in tree.find_all(nodes.Const) if isinstance(node.value, str)]
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
        return env.from_string(tree), tuple(literals)
    except TemplateSyntaxError as exc:
        raise ChatTemplateError(f"chat template does not compile: line {exc.lineno}: {exc.message}") from exc
    except RecursionError as exc:
        raise ChatTemplateError("chat template does not compile: nested too deeply") from exc
    except SyntaxError as exc:  # Python's own limits on the code it compiles to: nested blocks, indentation
        raise ChatTemplateError(f"chat template does not compile: nested too deeply ({exc.msg})") from exc
    except (LimitError, MemoryError) as exc:
        raise ChatTemplateError(f"chat template does not compile: {_what(exc)}") from exc


def render_bounded(template: Template, context: dict[str, Any]) -> str:
    """Render within the bounds above; any failure of the template becomes one ChatTemplateError line."""
    token = BUDGET.set(Budget())
    stream = template.generate(context)
    parts, size = [], 0
    try:
        for chunk in stream:
            size += len(chunk)
            if size > MAX_OUTPUT_CHARS:
                raise LimitError(f"the rendered prompt passed {MAX_OUTPUT_CHARS:,} characters")
            parts.append(chunk)
        return "".join(parts)
    except ChatTemplateError:
        raise  # raise_exception: the template's own message
    except Exception as exc:  # untrusted code can fail in any way, MemoryError too; the caller gets one clear error
        raise ChatTemplateError(_describe(exc)) from exc
    finally:
        stream.close()
        BUDGET.reset(token)


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
    if isinstance(exc, LimitError):
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
