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

import time
from collections.abc import Iterator
from dataclasses import replace
from typing import TYPE_CHECKING, Any

import numpy as np

from .constraints import GrammarMask, constraints_from
from .errors import InvalidParameterError
from .generation import OPTION_NAMES, TURN_OPTIONS, DecodeState, Ending, GenerationOptions
from .kvcache import Cache, check_generation_memory, make_cache
from .sampling import TokenPicker
from .speculative import prepare_speculative, speculative_decode, supports_multi_token_steps
from .text import TextAssembler

if TYPE_CHECKING:
    from .runner import Runner
    from .text import Tokenizer

__all__ = [
    "OPTION_NAMES",
    "TURN_OPTIONS",
    "DecodeState",
    "GenerationOptions",
    "decode",
    "generation_options",
    "with_text",
]


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
    draft folder is loaded and checked against it, and response_format / grammar / regex become the token_mask
    (runtime/constraints.py; a batch of `rows` may give one per row)."""
    unknown = set(options) - allowed
    if unknown:
        raise TypeError(f"{caller} got unexpected keyword argument(s) {', '.join(sorted(unknown))}")
    options = dict(options)
    constraint = constraints_from(options, rows)  # compiled here: a bad schema raises before anything runs
    if constraint is not None:
        if options.get("token_mask") is not None:
            raise InvalidParameterError("give a token_mask or response_format / grammar / regex, not both")
        if runner is None:
            raise InvalidParameterError("response_format, grammar and regex need the model: pass runner=")
        options["token_mask"] = GrammarMask(runner, constraint)
    checked = GenerationOptions(max_new_tokens=max_new_tokens, **options)
    if checked.stops and tokenizer is None:
        raise InvalidParameterError("stop strings need a tokenizer, and this package has none")
    speculative = checked.speculative if runner is None else prepare_speculative(checked.speculative, runner)
    return replace(checked, max_new_tokens=int(max_new_tokens), stop=checked.stops, speculative=speculative)


# ---- the loop ---------------------------------------------------------------------------------------


def prefill(cache: Cache, feed: list[int] | None = None) -> np.ndarray:
    """The first logits, (B, V): the whole prompt of a new cache, or `feed` after what a kept (batch-1) cache holds."""
    return cache.prompt() if feed is None else cache.extend(feed)[None, :]


def decode_step(cache: Cache, next_ids: np.ndarray) -> np.ndarray:
    """Feed one token per row, next_ids (B, 1); the logits of each row's new position, (B, V)."""
    return cache.next(next_ids)


def decode(
    runner: Runner,
    prompts: list[list[int]],
    state: DecodeState,
    options: GenerationOptions,
    *,
    cache: Cache | None = None,
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
    picker = TokenPicker(prompts, options.sampling, options.seed, mask=options.token_mask)
    ending = Ending(state, options, runner.spec.tokens.eos_token_ids)
    next_ids = np.empty((batch, 1), dtype=np.int64)
    first = True
    while not ending.done() and not ending.cancelled():
        logits = prefill(cache, feed) if first else decode_step(cache, next_ids)
        live = ending.live()
        tokens = picker.pick(logits, live)
        if first and not state.first_token_time:
            state.first_token_time = time.perf_counter()
        first = False
        next_ids.fill(runner.spec.tokens.pad_token_id)  # rows that have ended feed padding
        for row, token in zip(live, tokens, strict=True):
            if ending.is_end(row, token):
                continue
            next_ids[row, 0] = token
            picker.append(row, token)
            yield row, token
            ending.count(row)


# ---- text and stop strings ----------------------------------------------------------------------------


def with_text(
    decoding: Iterator[tuple[int, int]], assemblers: list[TextAssembler | None], state: DecodeState
) -> Iterator[tuple[int, int, str]]:
    """decode()'s (row, token) pairs with the text each token made final in its row's assembler ("" for a row
    without one). The one place a stop string ends a row: when the row's assembler finds one, state.finish[row]
    becomes "stop" before the pair is yielded, so the loop feeds that row nothing more. The caller flushes the
    assemblers at the end."""
    for row, token in decoding:
        assembler, piece = assemblers[row], ""
        if assembler is not None:
            piece = assembler.add(token)
            if assembler.stopped:
                state.finish[row] = "stop"
        yield row, token, piece


def text_pieces(decoding: Iterator[tuple[int, int]], assembler: TextAssembler, state: DecodeState) -> Iterator[str]:
    """The final text pieces of a batch-1 decode (decode()'s (row, token) pairs), cut at a stop string."""
    for _, _, piece in with_text(decoding, [assembler], state):
        if piece:
            yield piece


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
    for row, token, _ in with_text(decode(runner, prompts, state, options), assemblers, state):
        generated[row].append(token)
    if watch:
        return generated, [assembler.text for assembler in assemblers]
    return generated, [tokenizer.decode(ids) if tokenizer else "" for ids in generated]
