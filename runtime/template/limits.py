"""What one chat template render may spend, and what it has spent: the limits, and the per-render budget
(steps, call depth, bytes built, wall time) kept in a ContextVar. sandbox.py and filters.py admit every
operation's cost (costs.py) to it before the operation runs.
"""

from __future__ import annotations

import time
from contextvars import ContextVar
from typing import Any

from .sizes import Cost, Shape, shape

MAX_SOURCE_CHARS = 100_000  # a template's source; real ones are 0.5-17 kB
MAX_NODES = 20_000  # parsed template nodes; real templates have up to about 1,000
MAX_CODE_CHARS = 300_000  # the Python a template compiles to (compiling takes ~125 bytes per character)
MAX_OUTPUT_CHARS = 4_000_000  # the rendered prompt, and any one string or list a template builds
MAX_BUILT_BYTES = 48 << 20  # everything one render builds: every string, list and printed value, freed or not
MAX_STEPS = 200_000  # loop iterations plus calls in one render; a 1000-message chat takes ~10k
MAX_DEPTH = 64  # nested calls, i.e. macro recursion
MAX_CPU_SECONDS = 1.0  # the rendering thread's CPU time; real templates take milliseconds
MAX_SECONDS = 5.0  # wall time of one render (a thread that waits for the interpreter lock spends no CPU)
_CHECK_EVERY = 0.05  # seconds of wall time between readings of the thread's CPU time (a system call)
MAX_DATA_DEPTH = 32  # nesting of dicts and lists inside messages and variables
MAX_INT_BITS = 16_384  # a number built by * or **; 10 ** 4000 is still fine
# A list, tuple or dict counted through every reference (sizes.shape), as ==, <, in, hash, sort, min, max and
# unique walk it in one C call that no step check interrupts; [x, x] doubles, so 60 doublings would never end.
MAX_ENTRIES = 1_000_000
MAX_NESTING = 128  # lists, tuples and dicts inside each other (hashing a tuple recurses in C without a guard)

_ONE_ITEM = Cost(0, 1)


class LimitError(RuntimeError):
    """A render went past one of the bounds above."""


class Budget:
    """What one render has spent; lives in a ContextVar so threads rendering one template don't share it."""

    def __init__(self) -> None:
        self.steps = 0
        self.depth = 0
        self.built = 0  # bytes, as sizes.Cost counts them
        self.deadline = time.monotonic() + MAX_SECONDS
        self.cpu_deadline = time.thread_time() + MAX_CPU_SECONDS
        self.next_reading = time.monotonic() + _CHECK_EVERY
        self.shapes: dict[int, Shape] = {}  # containers measured in this render, by id
        # and the containers themselves, so that no id is reused while shapes lives (each was counted as built)
        self.measured: list = []

    def step(self) -> None:
        self.steps += 1
        if self.steps > MAX_STEPS:
            raise LimitError(f"more than {MAX_STEPS:,} loop iterations and calls (an endless loop?)")
        now = time.monotonic()
        if now > self.next_reading:  # CPU time never runs ahead of wall time: reading it now and then is enough
            self.next_reading = now + _CHECK_EVERY
            if time.thread_time() > self.cpu_deadline:
                raise LimitError(f"rendering took more than {MAX_CPU_SECONDS} s of CPU time")
            if now > self.deadline:
                raise LimitError(f"rendering took more than {MAX_SECONDS} s")

    def build(self, cost: Cost) -> None:
        """Admit what an operation is about to build, or refuse it before it allocates."""
        check_length(max(cost.chars, cost.items))
        self.built += cost.bytes
        if self.built > MAX_BUILT_BYTES:
            raise LimitError(f"the template built more than {MAX_BUILT_BYTES >> 20} MiB of text and lists")

    def measure(self, *values: Any) -> None:
        """Refuse values that together would make a comparison, hash or sort walk too much: a container the
        template built (a literal, an operator's, a filter's or a call's result) or the arguments of a call."""
        entries = 0
        for value in values:
            found = shape(value, self.shapes, self.measured, cap=MAX_ENTRIES, max_depth=MAX_NESTING)
            entries += found.entries
            if found.depth > MAX_NESTING:
                raise LimitError(f"lists, tuples or dicts nested more than {MAX_NESTING} deep")
            if entries > MAX_ENTRIES:
                raise LimitError(
                    f"lists, tuples or dicts of more than {MAX_ENTRIES:,} entries counted through every reference"
                )


BUDGET: ContextVar[Budget | None] = ContextVar("edgelm_chat_template_budget", default=None)


def current_budget() -> Budget:
    # Outside a render (a test calling a filter directly) a fresh budget still applies the size checks.
    return BUDGET.get() or Budget()


def check_length(length: int) -> None:
    if length > MAX_OUTPUT_CHARS:
        raise LimitError(f"a value of {length:,} items or characters (the limit is {MAX_OUTPUT_CHARS:,})")


def checked(value: Any) -> Any:
    """value, a result the template gets, once its length and shape pass the limits."""
    if isinstance(value, (str, bytes, list, tuple, dict)):
        check_length(len(value))
    current_budget().measure(value)
    return value


def check_arguments(args: tuple, kwargs: dict) -> None:
    for value in (*args, *kwargs.values()):
        # Widths and counts of callables no bound knows (and a second guard for those it does).
        if type(value) is int and abs(value) > MAX_OUTPUT_CHARS:
            raise LimitError(f"an argument of {value:,} (the limit is {MAX_OUTPUT_CHARS:,})")
    current_budget().measure(*args, *kwargs.values())  # a macro's varargs, a cycler's items: one tuple of them


def materialized(value: Any) -> Any:
    """value, or the items of an iterator in a list, each counted as it arrives (a filter will keep them)."""
    if isinstance(value, (str, bytes, list, tuple, dict, range)) or not hasattr(value, "__next__"):
        return value
    budget, items = current_budget(), []
    for item in value:
        budget.build(_ONE_ITEM)
        items.append(item)
        check_length(len(items))
    return items
