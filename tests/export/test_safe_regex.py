"""export/safe_regex.py: untrusted patterns answer exactly as re answers (a hypothesis property over random
patterns and texts), in linear time where re backtracks for ever, and a bad pattern is a PatternError."""

from __future__ import annotations

import re
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from edgelm.export.safe_regex import MAX_STATES, Pattern, PatternError

ATOMS = ["a", "b", ".", "_", r"\.", "[ab]", "[^a]", r"\d", r"\w", r"\W", "1", "^", "$", r"\b", r"\B", "[0-9]", r"\Z"]
REPEATS = ["*", "+", "?", "*?", "+?", "{2}", "{1,3}", "{0,2}?", "{2,}", "{,2}"]


def patterns():
    return st.recursive(
        st.sampled_from(ATOMS),
        lambda inner: st.one_of(
            st.tuples(inner, inner).map("".join),
            st.tuples(inner, inner).map(lambda t: f"(?:{t[0]}|{t[1]})"),
            st.tuples(inner, st.sampled_from(REPEATS)).map(lambda t: f"({t[0]}){t[1]}"),
        ),
        max_leaves=8,
    )


@settings(max_examples=600, deadline=None, suppress_health_check=list(HealthCheck))
@given(patterns(), st.text(alphabet="ab._1\n", max_size=8))
def test_answers_as_re(pattern, text):
    compiled = Pattern(pattern)
    assert compiled.match(text) == bool(re.match(pattern, text))
    assert compiled.fullmatch(text) == bool(re.fullmatch(pattern, text))


@pytest.mark.parametrize("pattern", ["(.*)*x", "(.*\\.)?((.*)*x)$", "(a|aa)*b", "(x+x+)+y", "((a*)*)*$"])
def test_backtracking_patterns_finish(pattern):
    name = "model.layers.10.self_attn.q_proj." * 8
    start = time.process_time()
    assert not Pattern(pattern).fullmatch(name + "!")
    assert time.process_time() - start < 1.0


@pytest.mark.parametrize(
    "pattern, message",
    [
        ("(", "not a valid regular expression"),
        ("a{5,2}", "not a valid regular expression"),
        ("(?i)q_proj", "inline flags"),
        ("(?=q)", "not supported"),
        ("(a)\\1", "not supported"),
        ("a" * 1001, "longer than"),
        (f"((a{{{MAX_STATES // 50}}}){{60}})", "too large"),
    ],
)
def test_bad_patterns_are_pattern_errors(pattern, message):
    with pytest.raises(PatternError, match=message):
        Pattern(pattern)
