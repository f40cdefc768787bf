"""A chat turn's reply, parsed as it grows into content, reasoning and tool calls (runtime/tool_calls.py's
conventions), for Conversation's streams and results (runtime/chat.py)."""

from __future__ import annotations

from .results import Piece
from .text import TextAssembler
from .tool_calls import Convention, ReplyParser, ToolCall, starts_in_reasoning


class Reply:
    """A turn's reply parsed as it grows (runtime/tool_calls.py): from the text the assembler decodes, or, when
    the convention's markup holds special tokens (which decoding drops), from a decoding that keeps them."""

    def __init__(self, tokenizer, convention: Convention, prompt_ids: list[int], parse_calls: bool, constrained: bool):
        self.convention = convention
        self.active = convention.name != "plain" or convention.think
        if not parse_calls and convention.name != "harmony":
            convention = Convention("plain", "", "", "", convention.calls, think=convention.think)
        specials = {tokenizer.token_text(i) for i in tokenizer.special_ids}
        self.keep_special = self.active and any(marker in specials for marker in convention.markers())
        self.calls: list[ToolCall] = []  # the calls parsed so far, each given its id once
        tail = tokenizer.decode(prompt_ids[-8:], skip_special=False) if self.active else ""
        # a prompt that opens <think> starts the reply in the reasoning, unless a grammar decides what is written
        self.parser = ReplyParser(convention, in_reasoning=starts_in_reasoning(tail) and not constrained)
        self.special_text = TextAssembler(_KeepSpecial(tokenizer)) if self.keep_special else None

    def _text(self, assembler: TextAssembler) -> str:
        if self.special_text is None:
            return assembler.text[: assembler.emitted]
        return self.special_text.text[: self.special_text.emitted]

    def add(self, token: int, assembler: TextAssembler):
        if not self.active:
            return None
        if self.special_text is not None and not assembler.stopped:
            self.special_text.add(token)
        delta = self.parser.update(self._text(assembler))
        return delta if (delta.content or delta.reasoning or delta.calls) else None

    def finish(self, assembler: TextAssembler):
        if not self.active:
            return None, _plain_parse(assembler.text)
        if self.special_text is not None:
            self.special_text.flush()
        text = self.special_text.text if self.special_text is not None else assembler.text
        delta, parsed = self.parser.finish(text)
        return delta, parsed

    def register(self, delta) -> list[ToolCall]:
        """The delta's calls as ToolCalls, each with its id, added to the reply's calls."""
        new = [ToolCall(self.convention.new_id(), name, arguments) for name, arguments in delta.calls]
        self.calls += new
        return new

    def piece(self, text: str, delta, calls: list[ToolCall] | None = None) -> Piece:
        """A stream piece: the raw text and what it added to the parsed reply."""
        if delta is None:
            return Piece(text, text if not self.active else "")
        return Piece(text, delta.content, delta.reasoning, self.register(delta) if calls is None else calls)

    def message(self, parsed, calls: list[ToolCall], assembler: TextAssembler) -> dict:
        """The assistant message the history keeps: the reply as written, or with its calls taken out."""
        if self.convention.name == "harmony" and self.active:
            message = {"role": "assistant", "content": parsed.content}
            if parsed.reasoning is not None:
                message["thinking"] = parsed.reasoning
        elif calls:
            message = {"role": "assistant", "content": parsed.kept.strip()}
        else:
            return {"role": "assistant", "content": assembler.text}
        if calls:
            message["tool_calls"] = [call.to_message() for call in calls]
        return message


class _KeepSpecial:
    """A tokenizer view that decodes special tokens as their text, for a TextAssembler."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special=False)


def _plain_parse(text: str):
    from .tool_calls import Parsed

    return Parsed(text, None, [], text)
