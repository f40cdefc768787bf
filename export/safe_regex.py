"""Untrusted regular expressions (PEFT's target_modules, exclude_modules, rank_pattern and alpha_pattern keys)
matched without backtracking: Python's own parser reads the pattern (so the syntax and a bad pattern's error are
re's), and a Thompson NFA (Thompson 1968; Cox 2007, "Regular Expression Matching Can Be Simple And Fast") runs
it in time proportional to the text's length times the pattern's states, where re's backtracking can take
exponential time (`(.*)*x`). The answer (match or not) is re's for every pattern it accepts: literals, classes,
`.`, groups, alternation, greedy and lazy repeats, `^ $ \\A \\Z \\b \\B`. What is not regular (backreferences,
lookaround, conditionals), possessive repeats, atomic groups and inline flags raise PatternError. A pattern
without repeats or alternation (a module path, `.` and `\\.` included, maybe `^...$`) is run by re itself, which
cannot backtrack far on it: the usual case, and the fast one.
"""

from __future__ import annotations

import re

try:  # Python 3.11+
    import re._constants as sre
    import re._parser as sre_parse
except ImportError:  # Python 3.10
    import sre_constants as sre  # type: ignore[no-redef]
    import sre_parse  # type: ignore[no-redef]

MAX_PATTERN = 1000  # characters in a pattern
MAX_STATES = 4_000  # NFA states once counted repeats are unrolled: bounds a match's work to states x length
_UNICODE = sre.SRE_FLAG_UNICODE
_PLAIN = re.compile(r"\^?(?:[\w.]|\\\.)*\$?", re.ASCII)  # letters, digits, _, . and \. only: no repeats to blow up


class PatternError(ValueError):
    """A pattern that is malformed, too large, or uses what this matcher does not run."""


class _State:
    __slots__ = ("kind", "test", "next")

    def __init__(self, kind: str, test=None, next=None):
        self.kind = kind  # "char": test(ch) then next[0]; "split": every next; "at": test(text, i); "match"
        self.test = test
        self.next: list[_State] = [] if next is None else next


def _is(code: int):
    c = chr(code)
    return lambda ch: ch == c


def _is_not(code: int):
    c = chr(code)
    return lambda ch: ch != c


def _word(ch: str) -> bool:
    return ch.isalnum() or ch == "_"


_CATEGORIES = {  # re's Unicode classes (\d is str.isdecimal, \s str.isspace, \w alphanumerics and "_")
    sre.CATEGORY_DIGIT: str.isdecimal,
    sre.CATEGORY_NOT_DIGIT: lambda ch: not ch.isdecimal(),
    sre.CATEGORY_SPACE: str.isspace,
    sre.CATEGORY_NOT_SPACE: lambda ch: not ch.isspace(),
    sre.CATEGORY_WORD: _word,
    sre.CATEGORY_NOT_WORD: lambda ch: not _word(ch),
}


def _boundary(text: str, i: int) -> bool:
    return (i > 0 and _word(text[i - 1])) != (i < len(text) and _word(text[i]))


_ANCHORS = {
    sre.AT_BEGINNING: lambda text, i: i == 0,
    sre.AT_BEGINNING_STRING: lambda text, i: i == 0,
    sre.AT_END: lambda text, i: i == len(text) or (i == len(text) - 1 and text[i] == "\n"),
    sre.AT_END_STRING: lambda text, i: i == len(text),
    sre.AT_BOUNDARY: _boundary,
    sre.AT_NON_BOUNDARY: lambda text, i: text != "" and not _boundary(text, i),  # re: never in an empty string
}


def _char_class(items: list) -> object:
    """A test for `[...]`: (LITERAL, c), (RANGE, (lo, hi)), (CATEGORY, c), a leading (NEGATE, None)."""
    negate = bool(items) and items[0][0] is sre.NEGATE
    tests = []
    for op, value in items[1:] if negate else items:
        if op is sre.LITERAL:
            tests.append(_is(value))
        elif op is sre.RANGE:
            tests.append(lambda ch, lo=value[0], hi=value[1]: lo <= ord(ch) <= hi)
        elif op is sre.CATEGORY and value in _CATEGORIES:
            tests.append(_CATEGORIES[value])
        else:
            raise PatternError(f"the character class item {op} is not supported")
    return lambda ch: any(test(ch) for test in tests) != negate


class _Builder:
    def __init__(self):
        self.states = 0

    def state(self, kind: str, test=None, next=None) -> _State:
        self.states += 1
        if self.states > MAX_STATES:
            raise PatternError(f"it is too large once its repeats are counted out (over {MAX_STATES} states)")
        return _State(kind, test, next)

    def sequence(self, items, after: _State) -> _State:
        for op, value in reversed(list(items)):
            after = self.item(op, value, after)
        return after

    def item(self, op, value, after: _State) -> _State:
        if op is sre.LITERAL:
            return self.state("char", _is(value), [after])
        if op is sre.NOT_LITERAL:
            return self.state("char", _is_not(value), [after])
        if op is sre.ANY:
            return self.state("char", lambda ch: ch != "\n", [after])
        if op is sre.IN:
            return self.state("char", _char_class(value), [after])
        if op is sre.AT and value in _ANCHORS:
            return self.state("at", _ANCHORS[value], [after])
        if op is sre.BRANCH:
            return self.state("split", None, [self.sequence(branch, after) for branch in value[1]])
        if op is sre.SUBPATTERN:
            _group, add_flags, del_flags, items = value
            if add_flags or del_flags:
                raise PatternError("inline flags such as (?i:...) are not supported")
            return self.sequence(items, after)
        if op in (sre.MAX_REPEAT, sre.MIN_REPEAT):  # greedy or lazy: the same strings match
            low, high, items = value
            if high == sre.MAXREPEAT:  # a loop: split into one more round or out
                loop = self.state("split")
                loop.next = [self.sequence(items, loop), after]
                start = loop
            else:
                start = after
                for _ in range(high - low):  # each optional round may end the repeat
                    start = self.state("split", None, [self.sequence(items, start), after])
            for _ in range(low):
                start = self.sequence(items, start)
            return start
        raise PatternError(f"{str(op).lower()} is not supported (only regular patterns: no lookaround, backreferences, "
                           "possessive repeats or atomic groups)")  # fmt: skip


class Pattern:
    """One untrusted pattern, parsed and built once; `match` (re.match: from the start, any end) and
    `fullmatch` (re.fullmatch) answer as re would, in linear time."""

    def __init__(self, pattern: str, *, plain: str | None = None):
        """plain: the user's part of pattern (a key PEFT wraps in its own regex); when it is plain (_PLAIN), re
        runs the pattern."""
        if not isinstance(pattern, str):
            raise PatternError(f"a pattern must be a string, got {type(pattern).__name__}")
        if len(pattern) > MAX_PATTERN:
            raise PatternError(f"it is longer than {MAX_PATTERN} characters")
        try:
            parsed = sre_parse.parse(pattern)
        except (re.error, OverflowError, RecursionError) as e:
            raise PatternError(f"it is not a valid regular expression ({str(e).splitlines()[0]})") from None
        if parsed.state.flags & ~_UNICODE & ~sre.SRE_FLAG_VERBOSE:
            raise PatternError("inline flags such as (?i) are not supported")
        self.pattern = pattern
        self.states = 0  # what one character of a match can cost at most: 0 when re runs it
        self._re = re.compile(pattern) if _PLAIN.fullmatch(pattern if plain is None else plain) else None
        if self._re is not None:
            return
        builder = _Builder()
        try:
            self._start = builder.sequence(parsed, _State("match"))
        except RecursionError:
            raise PatternError("its groups are nested too deeply") from None
        self.states = builder.states  # what one character of a match can cost at most

    def match(self, text: str) -> bool:
        return bool(self._re.match(text)) if self._re is not None else self._run(text, full=False)

    def fullmatch(self, text: str) -> bool:
        return bool(self._re.fullmatch(text)) if self._re is not None else self._run(text, full=True)

    def _run(self, text: str, *, full: bool) -> bool:
        current = self._closure([self._start], text, 0)
        for i, ch in enumerate(text):
            if not full and any(s.kind == "match" for s in current):
                return True
            current = self._closure([s.next[0] for s in current if s.kind == "char" and s.test(ch)], text, i + 1)
            if not current:
                return False
        return any(s.kind == "match" for s in current)

    @staticmethod
    def _closure(states: list[_State], text: str, i: int) -> list[_State]:
        """The states reachable from `states` at position i without reading a character."""
        seen: set[int] = set()
        out, stack = [], list(reversed(states))
        while stack:
            state = stack.pop()
            if id(state) in seen:
                continue
            seen.add(id(state))
            if state.kind == "split":
                stack.extend(reversed(state.next))
            elif state.kind == "at":
                if state.test(text, i):
                    stack.append(state.next[0])
            else:
                out.append(state)
        return out
