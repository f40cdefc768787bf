"""What a generation is given and leaves behind, and when it ends: shared by the plain loop (runtime/decode.py)
and speculative decoding (runtime/speculative.py), which both import it.

- GenerationOptions: every option, validated when made;
- DecodeState: why each row ended, and the counts a generation reports;
- Ending: the one rule for when a row ends (an end-of-sequence id, a stop string, the token budget, a
  cancellation), so the two loops cannot drift apart.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass, fields
from typing import Any

import numpy as np

from .constraints import CONSTRAINT_OPTIONS
from .errors import InvalidParameterError
from .sampling import SamplingParams, TokenMask

LOOKUP = "lookup"  # speculative="lookup": prompt lookup decoding (runtime/speculative.py)


@dataclass(frozen=True, kw_only=True)
class GenerationOptions:
    """Every option of a generation, validated when made (InvalidParameterError naming the bad one)."""

    max_new_tokens: int = 64  # tokens to generate at most
    temperature: float = 0.0  # 0 = greedy; see runtime/sampling.py for the rest of the sampling options
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None  # row r of a batch samples with seed + r; None = a fresh random state
    stop: str | Sequence[str] | None = None  # text that ends the generation (not included in it)
    cancel: threading.Event | None = None  # set from another thread to end the generation early
    truncate_prompt: bool = False  # drop the oldest prompt tokens when the prompt does not fit the context
    ignore_eos: bool = False  # keep generating past EOS (benchmarks)
    speculative: Any = None  # "lookup", a draft Model or package folder, or None (runtime/speculative.py)
    token_mask: TokenMask | None = None  # (row, ids so far, logits) -> masked logits, before every choice (sampling.py)

    def __post_init__(self) -> None:
        self.sampling  # noqa: B018  (SamplingParams checks its own ranges)
        n = self.max_new_tokens
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise InvalidParameterError(f"max_new_tokens must be an integer >= 0, got {n!r}")
        seed = self.seed
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, (int, np.integer)) or seed < 0):
            raise InvalidParameterError(f"seed must be a non-negative integer or None, got {seed!r}")
        stop = self.stop
        if stop is not None and not isinstance(stop, (str, list, tuple)):
            raise InvalidParameterError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        if any(not isinstance(s, str) or not s for s in self.stops):
            raise InvalidParameterError(f"stop must be a non-empty string or a list of them, got {stop!r}")
        for flag in ("truncate_prompt", "ignore_eos"):  # "no" or 0 would read as a bool, and "no" as True
            if not isinstance(getattr(self, flag), (bool, np.bool_)):
                raise InvalidParameterError(f"{flag} must be True or False, got {getattr(self, flag)!r}")
        if self.cancel is not None and not callable(getattr(self.cancel, "is_set", None)):
            raise InvalidParameterError(f"cancel must be a threading.Event or None, got {self.cancel!r}")
        check_speculative(self.speculative)
        if self.token_mask is not None and not callable(self.token_mask):
            raise InvalidParameterError(f"token_mask must be a callable or None, got {self.token_mask!r}")

    @property
    def sampling(self) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k,
            top_p=self.top_p,
            min_p=self.min_p,
            repetition_penalty=self.repetition_penalty,
        )

    @property
    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())


# response_format, grammar and regex become a token_mask (runtime/constraints.py, made by decode.generation_options)
OPTION_NAMES = frozenset(f.name for f in fields(GenerationOptions)) - {"max_new_tokens"} | set(CONSTRAINT_OPTIONS)
TURN_OPTIONS = OPTION_NAMES - {"truncate_prompt", "ignore_eos"}  # a chat turn fits its history itself


def check_speculative(value: Any) -> None:
    """InvalidParameterError unless value is None, "lookup", a loaded model or an existing package folder."""
    if value is None or value == LOOKUP or is_model(value):
        return
    if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
        return
    raise InvalidParameterError(
        f"speculative must be 'lookup', a draft Model, a package folder or None, got {value!r}"
        + (" (no such folder)" if isinstance(value, (str, os.PathLike)) else "")
    )


def is_model(value: Any) -> bool:
    return all(hasattr(value, name) for name in ("spec", "session", "tokenizer", "run"))


@dataclass
class DecodeState:
    """What a decode leaves behind besides its tokens; the consumer may end a row by setting its finish."""

    finish: list[str]  # per row: "" while running, then "eos", "stop", "length" or "cancelled"
    first_token_time: float = 0.0  # time.perf_counter() when the first token was sampled
    proposed_tokens: int = 0  # speculative decoding: tokens guessed ...
    accepted_tokens: int = 0  # ... and of them, accepted

    @classmethod
    def start(cls, batch: int) -> DecodeState:
        return cls(finish=[""] * batch)


class Ending:
    """When each row of a generation ends, for both loops. A row ends
    - "eos": at one of the package's end-of-sequence ids (not yielded; ignore_eos turns this off);
    - "stop": when the consumer that assembles its text sees a stop string and sets state.finish[row];
    - "length": when it has yielded max_new_tokens tokens;
    - "cancelled": when options.cancel is set before its next token is computed.
    The loop asks `cancelled()` before each next token, `is_end(row, token)` for each chosen token, and
    `count(row)` after yielding one; it runs while not `done()`."""

    def __init__(self, state: DecodeState, options: GenerationOptions, eos_token_ids: Sequence[int]):
        self.finish, self.budget, self.cancel = state.finish, options.max_new_tokens, options.cancel
        self.eos = frozenset() if options.ignore_eos else frozenset(eos_token_ids)
        self.counts = [0] * len(self.finish)  # tokens yielded per row
        if self.budget == 0:
            self.finish[:] = [reason or "length" for reason in self.finish]

    def live(self) -> list[int]:
        """The rows still running."""
        return [row for row, reason in enumerate(self.finish) if not reason]

    def done(self) -> bool:
        return all(self.finish)

    def cancelled(self) -> bool:
        """True, and every running row ends "cancelled", when the generation was cancelled."""
        if self.cancel is None or not self.cancel.is_set():
            return False
        self.finish[:] = [reason or "cancelled" for reason in self.finish]
        return True

    def is_end(self, row: int, token: int) -> bool:
        """Whether `token`, just chosen for row, ends it (an end-of-sequence id: it is not yielded)."""
        if token in self.eos:
            self.finish[row] = "eos"
            return True
        return False

    def count(self, row: int) -> None:
        """row yielded a token: it ends "length" at the budget, unless the consumer ended it already."""
        self.counts[row] += 1
        if self.counts[row] >= self.budget and not self.finish[row]:
            self.finish[row] = "length"

    def left(self, row: int) -> int:
        """Tokens row may still yield."""
        return self.budget - self.counts[row]
