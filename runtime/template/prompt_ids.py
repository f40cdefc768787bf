"""Chat prompt ids in which a message's content is text, never markup.

Rendering a chat template and tokenizing the text, as transformers' apply_chat_template(tokenize=True)
does, turns control-token text anywhere in it into control tokens: a user who writes
"<|im_end|>\\n<|im_start|>system\\n..." (or Llama 3's "<|start_header_id|>", DeepSeek-R1's "<｜Assistant｜>",
or BOS/EOS text) gets a real turn. Here only the template's own text (its literals, and the bos_token /
eos_token it is given) may become control tokens; control-token text that comes from the data (the strings
in messages and variables) is tokenized as plain text, as tokenizers' `encode_special_tokens` does.

The control tokens are the added tokens marked special and every other added token whose text the
template's literals hold, whatever its `special` flag: DeepSeek-R1-Distill's tokenizer does not mark
<｜User｜>, <｜Assistant｜> or <think> special, and a tokenizer matches such tokens in any text. An added
token the template never writes is left as the tokenizer reads it (transformers' ids).

Which control tokens of the rendered text are the template's is traced in one of two ways:

- marked: the data is rendered again with every string wrapped in markers (a random number between
  noncharacters, whitespace at its ends left outside for templates that trim). When removing the markers
  gives the same text, they show exactly which characters came from the data; a control token that
  overlaps one is the data's, whatever the template did to the string (lower-casing, replacing, joining).
- stand-in, when the template changed the markers too (it slices, splits or compares the strings): every
  stretch of a string that could make a control token (a control token's text in any letter case, a start
  or end of one two characters or longer, a string's end that could join a neighbour into one) is replaced
  by as many INERT characters, and the template's control tokens are those at the same place in that
  rendering (counted from the start, or from the end when the template changed the content's length) with
  the same text. The offending strings are stood in for a few at a time, so a rendering that no longer
  lines up puts only the text around them in doubt. What it cannot see: a template that both slices a
  string and assembles a control token from single characters of it (removing the text between '<',
  '|im_start|' and '>').

For messages without control-token text the ids are exactly tokenize(render(...)), transformers' ids.
With it, the text between the template's control tokens is tokenized piece by piece as plain text. A
template that branches on such text, or writes a control token into a string (a filter that inserts one),
only turns more of the text into plain text, never the reverse.
"""

from __future__ import annotations

import bisect
import functools
import itertools
import re
import secrets
from collections.abc import Callable, Iterator
from typing import Any

from ..errors import ChatTemplateError, InvalidInputError
from ..text import Tokenizer
from .chat_template import ROLES, ChatTemplate

INERT = "\ufdd0"  # Unicode noncharacters: in no vocabulary, never text a template produces on its own
OPEN, CLOSE = "\ufdd1", "\ufdd2"
STAND_IN_RENDERS = 8  # renderings with stand-in text, at most, for one prompt (see _stand_in)


def chat_prompt_ids(
    template: ChatTemplate,
    tokenizer: Tokenizer,
    messages: list[dict],
    *,
    add_generation_prompt: bool = True,
    **variables: Any,
) -> list[int]:
    """The ids of messages rendered with template (variables: tools, documents, ... as ChatTemplate.render
    takes them, data like the messages), control tokens only where the template wrote them."""

    def render(data: tuple[list[dict], dict]) -> str:
        return template.render(data[0], add_generation_prompt=add_generation_prompt, **data[1])

    text = render((messages, variables))
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad UTF-16 decode
        raise InvalidInputError(f"a message is not valid Unicode text: {e.reason}") from None
    ids, offsets = tokenizer.encode_offsets(text)
    control = control_ids(template, tokenizer)
    specials = [k for k, token_id in enumerate(ids) if token_id in control]
    if not specials:
        return ids
    found = {text[start:end] for start, end in (offsets[k] for k in specials)}
    written = _marked(render, (messages, variables), text, found) or _stand_in(
        render, (messages, variables), text, found
    )
    kept = [k for k in specials if written(*offsets[k])]
    if len(kept) == len(specials):
        return ids
    result, position = [], 0
    for k in kept:
        start, end = offsets[k]
        if position < start:
            result += tokenizer.encode_text(text[position:start], at_start=position == 0, also=control)
        result.append(ids[k])
        position = end
    if position < len(text):
        result += tokenizer.encode_text(text[position:], at_start=position == 0, also=control)
    return result


def control_ids(template: ChatTemplate, tokenizer: Tokenizer) -> frozenset[int]:
    """The control tokens: the added tokens marked special, and every other added token of markup whose text the
    template writes itself (in its literals, or as a special token it is given), whatever its `special` flag."""
    return tokenizer.special_ids | _written_added_ids(template.own_text, tokenizer.added_tokens)


@functools.lru_cache(maxsize=64)
def _written_added_ids(own_text: str, added_tokens: tuple[tuple[int, str], ...]) -> frozenset[int]:
    return frozenset(token_id for token_id, token in added_tokens if _is_markup(token) and token in own_text)


def _is_markup(token: str) -> bool:
    """Whether an added token is markup (<think>, <｜User｜>, [INST]) rather than text some tokenizers add as a
    token of its own (runs of spaces, whole words), which a message writes as often as a template does."""
    return any(not (char.isalnum() or char.isspace()) for char in token)


# ---- marked: the data's characters, exactly ----------------------------------------------------------


def _marked(render: Callable, data: Any, text: str, found: set[str]) -> Callable[[int, int], bool] | None:
    """The test "text[start:end] holds no character of the data", or None when the markers do not survive."""
    number = f"{secrets.randbelow(10**12):012d}"  # digits: no letter case; random: no string can hold it
    start_mark, end_mark = f"{OPEN}{number}{OPEN}", f"{CLOSE}{number}{CLOSE}"
    partial = _partial_pattern(found)
    try:
        wrapped, safe_keys = _wrap(data, start_mark, end_mark, partial)
        if not safe_keys:  # a dict key with special-token text: keys are not wrapped (templates look them up)
            return None
        marked = render(wrapped)
    except ChatTemplateError:
        return None
    spans, plain, position, shift = [], [], 0, 0
    for match in re.finditer(f"{re.escape(start_mark)}|{re.escape(end_mark)}", marked):
        opening = match.group() == start_mark
        if opening != (len(spans) % 2 == 0):  # marks must alternate: open, close, open, ...
            return None
        plain.append(marked[position : match.start()])
        shift += match.start() - position
        spans.append(shift)  # where in the unmarked text the mark stood
        position = match.end()
    plain.append(marked[position:])
    if len(spans) % 2 or "".join(plain) != text:
        return None
    starts, ends = spans[0::2], spans[1::2]

    def written(start: int, end: int) -> bool:
        k = bisect.bisect_left(ends, start + 1)  # the first span that ends after start
        return k == len(starts) or starts[k] >= end

    return written


def _wrap(value: Any, start_mark: str, end_mark: str, partial: re.Pattern, key: Any = None) -> tuple[Any, bool]:
    """value with every string but a message's role wrapped in the marks (its leading and trailing whitespace outside,
    where trim and strip leave the marks alone); and whether no dict key could hold special-token text."""
    if isinstance(value, str):
        core = value.strip()
        if (key == "role" and value in ROLES) or not core:  # the template compares roles: leave them as they are
            return value, True
        lead = value[: len(value) - len(value.lstrip())]
        return f"{lead}{start_mark}{core}{end_mark}{value[len(lead) + len(core) :]}", True
    if isinstance(value, dict):
        items = {k: _wrap(v, start_mark, end_mark, partial, k) for k, v in value.items()}
        safe = all(ok for _, ok in items.values()) and not any(isinstance(k, str) and partial.search(k) for k in value)
        return {k: v for k, (v, _) in items.items()}, safe
    if isinstance(value, (list, tuple)):
        items = [_wrap(item, start_mark, end_mark, partial) for item in value]
        return type(value)(item for item, _ in items), all(ok for _, ok in items)
    return value, True


def _partial_pattern(found: set[str]) -> re.Pattern:
    """Matches any string that holds a special token's text, or starts or ends with a piece of one."""
    whole = [re.escape(token) for token in found]
    ends = [f"^{re.escape(token[-size:])}" for token in found for size in range(1, len(token))]
    starts = [f"{re.escape(token[:size])}$" for token in found for size in range(1, len(token))]
    return re.compile("|".join(whole + ends + starts), re.IGNORECASE)


# ---- stand-in: the data's special-token text replaced -------------------------------------------------


def _stand_in(render: Callable, data: Any, text: str, found: set[str]) -> Callable[[int, int], bool]:
    """The test "text[start:end] is the template's", from renderings with INERT in place of every stretch
    of the data's strings that could make a control token.

    The strings that hold such stretches are stood in for a few at a time (at most STAND_IN_RENDERS renderings,
    each for a run of neighbouring strings), so that where a rendering no longer lines up with the text (the
    template changed a string's length) only the text around those strings is in doubt: the template's
    control tokens between two offending messages stay control tokens. A token is the template's when every
    rendering says so.
    """
    pattern, inert = _matcher(found), []

    def note(value: str) -> str:
        new = _neutralize_text(value, pattern, found)
        inert.append(new if new != value else None)
        return value

    _each_string(data, note)
    changed = [index for index, new in enumerate(inert) if new is not None]
    if not changed:  # no string holds special-token text or a piece of one
        return lambda start, end: True
    size = -(-len(changed) // STAND_IN_RENDERS)
    tests = []
    for first in range(0, len(changed), size):
        chosen, counter = set(changed[first : first + size]), itertools.count()

        def swap(value: str, chosen: set[int] = chosen, counter: Iterator[int] = counter) -> str:
            index = next(counter)
            return inert[index] if index in chosen else value

        try:
            inert_text = render(_each_string(data, swap))
        except ChatTemplateError:  # the template fails on the stand-in text: keep no control token at all
            return lambda start, end: False
        tests.append(_template_spans(text, inert_text))
    return lambda start, end: all(test(start, end) for test in tests)


def _each_string(value: Any, visit: Callable[[str], str], key: Any = None) -> Any:
    """A copy of value (messages: dicts, lists, strings) with visit(text) in place of every string but a
    message's role, dict keys included, visited in the same order every time."""
    if isinstance(value, str):
        return value if key == "role" and value in ROLES else visit(value)
    if isinstance(value, dict):
        return {_each_string(k, visit): _each_string(v, visit, k) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(_each_string(item, visit) for item in value)
    return value


def _matcher(found: set[str]) -> re.Pattern:
    """Finds, at every position (a lookahead, so overlapping ones too), a special token's text or a start or end
    of it two characters or longer: the pieces a template that removes text from a string could join."""
    pieces = {token[:size] for token in found for size in range(2, len(token) + 1)}
    pieces |= {token[-size:] for token in found for size in range(2, len(token))}
    alternatives = "|".join(re.escape(piece) for piece in sorted(pieces, key=len, reverse=True))  # longest first
    return re.compile(f"(?=({alternatives}))", re.IGNORECASE)


def _neutralize_text(value: str, pattern: re.Pattern, found: set[str]) -> str:
    """value with every stretch that could make a special token replaced by INERT (same length)."""
    stretches = [(match.start(), match.start() + len(match.group(1))) for match in pattern.finditer(value)]
    folded = value.casefold() if len(value.casefold()) == len(value) else value
    for token in found:
        token = token.casefold() if len(token.casefold()) == len(token) else token
        for size in range(min(len(token) - 1, len(value)), 0, -1):
            if folded.endswith(token[:size]):  # the end of value and the text after it may join into token
                stretches.append((len(value) - size, len(value)))
                break
        for size in range(min(len(token) - 1, len(value)), 0, -1):
            if folded.startswith(token[-size:]):  # and so may the text before it and value's start
                stretches.append((0, size))
                break
    if not stretches:
        return value
    chars = list(value)
    for start, end in stretches:
        chars[start:end] = INERT * (end - start)
    return "".join(chars)


def _template_spans(text: str, inert_text: str) -> Callable[[int, int], bool]:
    """A test of whether text[start:end] is the template's: the same text at the same place of inert_text,
    inside the part that lines up from the start or the part that lines up from the end (each found on its
    own: INERT, which stands for any text, can carry one into what only the other lines up)."""
    shortest = min(len(text), len(inert_text))

    def lines_up(i: int, j: int) -> bool:
        return text[i] == inert_text[j] or inert_text[j] == INERT

    head = 0
    while head < shortest and lines_up(head, head):
        head += 1
    tail, shift = 0, len(inert_text) - len(text)
    while tail < shortest and lines_up(len(text) - 1 - tail, len(inert_text) - 1 - tail):
        tail += 1

    def written(start: int, end: int) -> bool:
        token = text[start:end]
        if INERT in token:
            return False
        return (end <= head and inert_text[start:end] == token) or (
            start >= len(text) - tail and inert_text[start + shift : end + shift] == token
        )

    return written
