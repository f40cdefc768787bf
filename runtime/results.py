"""What generation returns: the result of a call, its timings, and the stream of text pieces."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .tool_calls import ToolCall


@dataclass
class Timings:
    prompt_tokens: int = 0
    new_tokens: int = 0
    time_to_first_token_s: float = 0.0  # from the call to the first sampled token (prompt pass included)
    decode_tokens_per_s: float = 0.0  # tokens after the first, per second
    total_s: float = 0.0
    proposed_tokens: int = 0  # speculative decoding: tokens guessed (runtime/speculative.py) ...
    accepted_tokens: int = 0  # ... and of them, accepted by the model


@dataclass
class GenerationResult:
    text: str  # the generated text (a stop string is not included)
    token_ids: list[int]  # the generated ids (EOS not included)
    finish_reason: str  # "eos", "stop", "length" or "cancelled"
    prompt_token_ids: list[int] = field(default_factory=list)
    timings: Timings = field(default_factory=Timings)
    # a chat reply parsed by its template's convention (runtime/tool_calls.py); content is text without one
    content: str | None = None  # the answer: text without the reasoning and the tool-call markup
    reasoning: str | None = None  # the model's reasoning (<think>...</think> and the like), None if it wrote none
    tool_calls: list[ToolCall] = field(default_factory=list)

    def __post_init__(self) -> None:
        if self.content is None:
            self.content = self.text

    def to_dict(self) -> dict:
        return {
            "text": self.text,
            "content": self.content,
            "reasoning": self.reasoning,
            "tool_calls": [call.to_openai() for call in self.tool_calls],
            "token_ids": self.token_ids,
            "finish_reason": self.finish_reason,
            "prompt_tokens": len(self.prompt_token_ids),
            "timings": self.timings.__dict__,
        }


class Piece(str):
    """A streamed text piece (a str: the raw text) with what it added to the parsed reply: content, reasoning and
    the tool calls completed by it (runtime/tool_calls.py). Without a convention, content is the piece itself."""

    content: str
    reasoning: str
    tool_calls: list[ToolCall]

    def __new__(cls, text: str, content: str | None = None, reasoning: str = "", tool_calls=None) -> Piece:
        piece = super().__new__(cls, text)
        piece.content = text if content is None else content
        piece.reasoning = reasoning
        piece.tool_calls = list(tool_calls or [])
        return piece


class Stream:
    """An iterator of final text pieces; after it is exhausted, .result holds the GenerationResult."""

    def __init__(self, pieces: Iterator[str]):
        self._pieces = pieces
        self.result: GenerationResult | None = None

    def __iter__(self) -> Iterator[str]:
        return self

    def __next__(self) -> str:
        return next(self._pieces)

    def finish(self) -> GenerationResult:
        """Run the stream to its end and return its result."""
        for _ in self._pieces:
            pass
        assert self.result is not None, "a stream sets its result when it ends"
        return self.result


def make_timings(
    started: float, first: float, ended: float, prompt_tokens: int, new_tokens: int, *, state=None
) -> Timings:
    """Timings of a generation; `state` (runtime/decode.py's DecodeState) adds speculative decoding's counts."""
    ttft = (first - started) if first else 0.0
    decode_time = ended - first if first else 0.0
    rate = (new_tokens - 1) / decode_time if new_tokens > 1 and decode_time > 0 else 0.0
    return Timings(
        prompt_tokens=prompt_tokens,
        new_tokens=new_tokens,
        time_to_first_token_s=ttft,
        decode_tokens_per_s=rate,
        total_s=ended - started,
        proposed_tokens=state.proposed_tokens if state is not None else 0,
        accepted_tokens=state.accepted_tokens if state is not None else 0,
    )
