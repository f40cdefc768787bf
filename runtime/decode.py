"""The decode loop shared by Model.generate/stream/generate_batch and Conversation: options, steps, stop strings.

The loop has one shape (onnxruntime-genai's `while not generator.is_done()`, gpt-fast's `prefill` then
`decode_one_token`): feed the prompt, then sample, append, feed one token, until EOS, a stop string, the
token budget or a cancellation. It drives a KV cache (runtime/kvcache.py) made for a narrow runner
(runtime/runner.py), so it knows nothing of how a model was loaded.

    options = generation_options(64, {"temperature": 0.8, "seed": 0}, tokenizer=model.tokenizer)
    state = DecodeState.start(len(prompts))
    for row, token in decode(model, prompts, state, options):
        ...
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields, replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .constraints import CONSTRAINT_OPTIONS, constraints_from, matchers
from .errors import InvalidParameterError, non_finite_logits
from .kvcache import check_generation_memory, make_cache
from .sampling import SamplingParams, sample
from .speculative import check_speculative, prepare_speculative, speculative_decode, supports_multi_token_steps
from .text import TextAssembler

if TYPE_CHECKING:
    from .runner import Runner
    from .text import Tokenizer


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
    # from response_format / grammar / regex: a Constraint, or one per row (runtime/constraints.py)
    constraint: Any = None

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
        if self.cancel is not None and not callable(getattr(self.cancel, "is_set", None)):
            raise InvalidParameterError(f"cancel must be a threading.Event or None, got {self.cancel!r}")
        check_speculative(self.speculative)

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


OPTION_NAMES = frozenset(f.name for f in fields(GenerationOptions)) - {"max_new_tokens", "constraint"}
OPTION_NAMES |= frozenset(CONSTRAINT_OPTIONS)
TURN_OPTIONS = OPTION_NAMES - {"truncate_prompt", "ignore_eos"}  # a chat turn fits its history itself


def generation_options(
    max_new_tokens: Any,
    options: dict[str, Any],
    *,
    tokenizer: Tokenizer | None,
    allowed: frozenset[str] = OPTION_NAMES,
    caller: str = "options()",
    runner: Runner | None = None,
    rows: int | None = None,
) -> GenerationOptions:
    """Options from keyword arguments, checked once: TypeError for an unknown name, InvalidParameterError for a
    bad value. The result holds max_new_tokens as an int and stop as a tuple; with a `runner`, a speculative
    draft folder is loaded and checked against it. rows: a batch's size, when a constraint may be given per row."""
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    options = dict(options)
    constraint = constraints_from(options, rows)  # compiled here: a bad schema raises before anything runs
    checked = GenerationOptions(max_new_tokens=max_new_tokens, constraint=constraint, **options)
    if checked.stops and tokenizer is None:
        raise InvalidParameterError("stop strings need a tokenizer, and this package has none")
    speculative = checked.speculative if runner is None else prepare_speculative(checked.speculative, runner)
    return replace(checked, max_new_tokens=int(max_new_tokens), stop=checked.stops, speculative=speculative)


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


# ---- the loop ---------------------------------------------------------------------------------------


def prefill(cache, feed: list[int] | None = None) -> np.ndarray:
    """The first logits, (B, V): the whole prompt of a new cache, or `feed` after what a kept (batch-1) cache holds."""
    return cache.prompt() if feed is None else cache.extend(feed)[None, :]


def decode_step(cache, next_ids: np.ndarray) -> np.ndarray:
    """Feed one token per row, next_ids (B, 1); the logits of each row's new position, (B, V)."""
    return cache.next(next_ids)


class TokenPicker:
    """Chooses each live row's next token from its logits: one seeded generator per row, the tokens seen so far
    for a repetition penalty, and a single argmax pass when decoding is greedy without a penalty."""

    def __init__(self, prompts: list[list[int]], params: SamplingParams, seed: int | None, constrained=None):
        self.params = params
        self.constrained = constrained  # one grammar Matcher (or None) per row: runtime/constraints.py
        self.rngs = [np.random.default_rng(None if seed is None else seed + row) for row in range(len(prompts))]
        self.penalize = params.repetition_penalty != 1.0
        self.seen = [np.array(p, dtype=np.int64) for p in prompts] if self.penalize else []
        self.argmax_only = params.greedy and not self.penalize  # then one pass over the logits is all a step needs

    def pick(self, logits: np.ndarray, live: list[int]) -> list[int]:
        """logits (B, V); the tokens of the rows in `live`, in order. PackageError for non-finite logits."""
        rows = raw = logits[live] if len(logits) > 1 else logits
        if self.constrained is not None:  # the grammar's mask, before any choice (-inf: not a broken model)
            masks = [self.constrained[row] for row in live]
            rows = np.stack([m.mask(r) if m else r for m, r in zip(masks, rows, strict=True)])
            logits = np.zeros((max(live) + 1, rows.shape[-1]), rows.dtype)
            logits[live] = rows
        if self.argmax_only:
            # argmax returns a NaN's index if there is one, and +inf's before any finite value, so the chosen
            # logits are finite exactly when the pick is sound (a -inf beside finite logits cannot change it);
            # this replaces a second pass over the vocabulary for the check
            picks = rows.argmax(axis=-1)
            checked = rows[np.arange(len(rows)), picks]
        else:
            checked = raw
        if not np.isfinite(checked).all():
            raise non_finite_logits()
        if self.argmax_only:
            return [int(token) for token in picks]
        return [
            sample(logits[row], self.params, self.rngs[row], self.seen[row] if self.penalize else None) for row in live
        ]

    def append(self, row: int, token: int) -> None:
        if self.constrained is not None and self.constrained[row] is not None:
            self.constrained[row].take(token)
        if self.penalize:
            self.seen[row] = np.append(self.seen[row], token)


def decode(
    runner: Runner,
    prompts: list[list[int]],
    state: DecodeState,
    options: GenerationOptions,
    *,
    cache=None,
    feed: list[int] | None = None,
) -> Iterator[tuple[int, int]]:
    """Batched decoding: yields (row, token id) for every new token of an unfinished row; state.finish[row]
    records why a row ended. A chat turn passes its batch-1 `cache`, which holds prompts[0] but its last
    len(feed) ids, and the `feed` to extend it with."""
    batch, max_new_tokens = len(prompts), options.max_new_tokens
    check_generation_memory(runner.spec, list(map(len, prompts)), new_tokens=max_new_tokens, kv_dtype=runner.kv_dtype)
    if options.speculative is not None and batch == 1 and supports_multi_token_steps(runner):
        yield from speculative_decode(runner, prompts[0], state, options, cache=cache, feed=feed)  # a batch: plain
        return
    if cache is None:
        cache = make_cache(runner, prompts, capacity=max(len(p) for p in prompts) + max_new_tokens)
    else:
        assert batch == 1 and feed, "a kept cache continues one row with at least one new token"
    picker = TokenPicker(prompts, options.sampling, options.seed, matchers(runner, options.constraint, batch))
    eos = set() if options.ignore_eos else set(runner.spec.tokens.eos_token_ids)
    finish, next_ids = state.finish, np.empty((batch, 1), dtype=np.int64)
    for step in range(max_new_tokens):
        if options.cancel is not None and options.cancel.is_set():
            finish[:] = [reason or "cancelled" for reason in finish]
            break
        logits = prefill(cache, feed) if step == 0 else decode_step(cache, next_ids)
        live = [row for row in range(batch) if not finish[row]]
        tokens = picker.pick(logits, live)
        if step == 0 and not state.first_token_time:
            state.first_token_time = time.perf_counter()
        next_ids.fill(runner.spec.tokens.pad_token_id)  # rows that have ended feed padding
        for row, token in zip(live, tokens, strict=True):
            if token in eos:
                finish[row] = "eos"
                continue
            next_ids[row, 0] = token
            picker.append(row, token)
            yield row, token
        if all(finish):
            break
    finish[:] = [reason or "length" for reason in finish]


# ---- text and stop strings ----------------------------------------------------------------------------


def text_pieces(decoding: Iterator[tuple[int, int]], assembler: TextAssembler, state: DecodeState) -> Iterator[str]:
    """The final text pieces of a batch-1 decode (decode()'s (row, token) pairs); a stop string ends the row
    (state.finish[0] = "stop"). The caller flushes the assembler at the end."""
    for _, token in decoding:
        piece = assembler.add(token)
        if piece:
            yield piece
        if assembler.stopped:
            state.finish[0] = "stop"


def decode_texts(
    runner: Runner,
    prompts: list[list[int]],
    state: DecodeState,
    options: GenerationOptions,
    tokenizer: Tokenizer | None,
) -> tuple[list[list[int]], list[str]]:
    """Decode a batch to the end: each row's new token ids and text (cut before a stop string)."""
    # text is assembled token by token only to find stop strings; without them it is decoded once at the end
    watch = tokenizer is not None and bool(options.stops)
    assemblers = [TextAssembler(tokenizer, options.stops) if watch else None for _ in prompts]
    generated: list[list[int]] = [[] for _ in prompts]
    for row, token in decode(runner, prompts, state, options):
        generated[row].append(token)
        if assemblers[row] is not None:
            assemblers[row].add(token)
            if assemblers[row].stopped:
                state.finish[row] = "stop"
    if watch:
        return generated, [assembler.text for assembler in assemblers]
    return generated, [tokenizer.decode(ids) if tokenizer else "" for ids in generated]
