"""Chat prompt ids in which a message's content is text, never markup.

Rendering a chat template and tokenizing the text, as transformers' apply_chat_template(tokenize=True)
does, turns special-token text anywhere in it into control tokens: a user who writes
"<|im_end|>\\n<|im_start|>system\\n..." (or Llama 3's "<|start_header_id|>", or BOS/EOS text) gets a real
system turn. Here only the template's own text (its literals, and the bos_token / eos_token it is given)
may become special tokens; special-token text that comes from the data (messages and variables) is
tokenized as plain text, as tokenizers' `encode_special_tokens` does.

How a control token is traced to the template: the messages are rendered a second time with every
stretch of their strings that could make one (an occurrence of a special token's text, any letter case,
or a string's end that could join a neighbour into one) replaced by as many copies of INERT, a character
no token contains. Template text stays where it was, so a special token of the first rendering is the
template's when the second rendering has the same text at the same place (counted from the start, or
from the end when the template changed the content's length); any other is the data's. A template that
branches on such text can only move more of the text into the second, conservative kind.

For messages without such text the ids are exactly tokenize(render(...)), transformers' ids. With it,
the text between the template's control tokens is tokenized piece by piece without special tokens.
"""

from __future__ import annotations

import re
from typing import Any

from .chat_template import ChatTemplate
from .errors import ChatTemplateError, InvalidInputError
from .text import Tokenizer

INERT = "\ufdd0"  # a Unicode noncharacter: in no vocabulary, never text a template produces on its own


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
    text = template.render(messages, add_generation_prompt=add_generation_prompt, **variables)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:  # a lone surrogate, e.g. from a bad UTF-16 decode
        raise InvalidInputError(f"a message is not valid Unicode text: {e.reason}") from None
    ids, offsets = tokenizer.encode_offsets(text)
    specials = [k for k, token_id in enumerate(ids) if token_id in tokenizer.special_ids]
    if not specials:
        return ids
    found = {text[start:end] for start, end in (offsets[k] for k in specials)}
    (inert_messages, inert_variables), changed = _neutralize((messages, variables), _matcher(found), found)
    if not changed:  # no string holds special-token text or the start or end of one
        return ids
    try:
        inert_text = template.render(inert_messages, add_generation_prompt=add_generation_prompt, **inert_variables)
    except ChatTemplateError:  # the template fails on the stand-in text: keep no control token at all
        inert_text = ""
    written = _template_spans(text, inert_text)
    kept = [k for k in specials if written(*offsets[k])]
    if len(kept) == len(specials):
        return ids
    result, position = [], 0
    for k in kept:
        start, end = offsets[k]
        if position < start:
            result += tokenizer.encode_text(text[position:start], at_start=position == 0)
        result.append(ids[k])
        position = end
    if position < len(text):
        result += tokenizer.encode_text(text[position:], at_start=position == 0)
    return result


def _matcher(found: set[str]) -> re.Pattern:
    # longest first, so that of two overlapping texts the whole longer one is replaced
    return re.compile("|".join(re.escape(t) for t in sorted(found, key=len, reverse=True)), re.IGNORECASE)


def _neutralize_text(value: str, pattern: re.Pattern, found: set[str]) -> str:
    """value with every stretch that could make a special token replaced by INERT (same length)."""
    chars = list(value)
    for match in pattern.finditer(value):
        chars[match.start() : match.end()] = INERT * (match.end() - match.start())
    folded = value.casefold() if len(value.casefold()) == len(value) else value
    for token in found:
        token = token.casefold() if len(token.casefold()) == len(token) else token
        for size in range(min(len(token) - 1, len(value)), 0, -1):
            if folded.endswith(token[:size]):  # the end of value and the text after it may join into token
                chars[len(value) - size :] = INERT * size
                break
        for size in range(min(len(token) - 1, len(value)), 0, -1):
            if folded.startswith(token[-size:]):  # and so may the text before it and value's start
                chars[:size] = INERT * size
                break
    return "".join(chars)


def _neutralize(value: Any, pattern: re.Pattern, found: set[str], key: str | None = None) -> tuple[Any, bool]:
    """A copy of value (messages: dicts, lists, strings) with every string but a role neutralized; and whether
    anything changed."""
    if isinstance(value, str) and key != "role":
        new = _neutralize_text(value, pattern, found)
        return new, new != value
    if isinstance(value, dict):
        pairs = [(_neutralize(k, pattern, found), _neutralize(v, pattern, found, k)) for k, v in value.items()]
        return {k: v for (k, _), (v, _) in pairs}, any(a or b for (_, a), (_, b) in pairs)
    if isinstance(value, (list, tuple)):
        items = [_neutralize(item, pattern, found) for item in value]
        return type(value)(item for item, _ in items), any(changed for _, changed in items)
    return value, False


def _template_spans(text: str, inert_text: str):
    """A test of whether text[start:end] is the template's: the same text at the same place of inert_text,
    with no INERT in it, inside the part that lines up from the start or the part that lines up from the end."""
    shortest = min(len(text), len(inert_text))

    def lines_up(i: int, j: int) -> bool:
        return text[i] == inert_text[j] or inert_text[j] == INERT

    head = 0
    while head < shortest and lines_up(head, head):
        head += 1
    tail, shift = 0, len(inert_text) - len(text)
    while tail < shortest - head and lines_up(len(text) - 1 - tail, len(inert_text) - 1 - tail):
        tail += 1

    def written(start: int, end: int) -> bool:
        if end <= head:
            other = inert_text[start:end]
        elif start >= len(text) - tail:
            other = inert_text[start + shift : end + shift]
        else:
            return False
        return INERT not in other and other == text[start:end]

    return written
