"""Speculative decoding: guess several next tokens cheaply, check them all in one run of the model.

Each round feeds the newest token and k guessed ones as one multi-token step (logits for every position),
keeps the longest run of guesses the model agrees with plus the model's own next token, and rewinds the KV
cache past the rest. A hybrid model's states cannot be cut back (runtime/statecache.py _Snapshots): its cache goes
back to the snapshot taken before the round, and the accepted ids are fed again in front of the next round's
(docs/hybrid.md: that costs no run of its own). Two ways to guess (speculative= in generate/stream/chat/conversation):

- "lookup": prompt lookup decoding (Saxena 2023; llama.cpp's lookup): the longest of the last n tokens
  (n in NGRAM_SIZES) that occurred before, in the prompt or the output, proposes the tokens that followed it;
- a draft Model (or package folder) with the same tokenizer, which proposes k tokens from its own kept cache.

Greedy output is the plain greedy output, token for token. With sampling, a guess x is accepted with
probability min(1, p(x)/q(x)) and a rejection draws from max(0, p - q), normalised (Leviathan et al. 2023,
Chen et al. 2023), so every token is distributed as plain sampling's p; lookup's q is a point mass. Every
position is chosen by plain decoding's own picker (sampling.TokenPicker: its token mask, repetition penalty and
transforms; p is its `probabilities`), and the loop ends as plain decoding's does (generation.Ending).
k adapts: it grows while guesses are accepted and shrinks on a rejection; no guess makes a plain step.
A batch of several prompts decodes plainly (runtime/decode.py), and so does a package whose graph computes a step
of several tokens differently from steps of one (row_dependent_operator), with a warning.
"""

from __future__ import annotations

import contextlib
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from .errors import InvalidParameterError
from .generation import LOOKUP, DecodeState, Ending, GenerationOptions, check_speculative, is_model
from .kvcache import Cache, make_cache
from .onnx_external import operators
from .packed import graph_path
from .sampling import TokenPicker

if TYPE_CHECKING:
    from .runner import Runner

NGRAM_SIZES = (3, 2)  # prompt lookup matches the last 3 tokens, else the last 2 (one token matches too often)
MAX_DRAFT = 10  # guesses per round at most
FIRST_DRAFT = 4  # guesses in the first round
STEP_TOLERANCE = 1e-3  # logits of a multi-token step may differ from one-token steps' by this, relative
# Checked once per model. Keyed by what a model shares with its adapters' runners (runtime/adapters.py), which
# are made per request: the tokenizer and the ONNX Runtime session.
_same_vocabulary: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> draft tokenizers it matches
_consistent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> supports_multi_token_steps


def prepare_speculative(value: Any, runner: Runner) -> Any:
    """The speculative option ready to decode with: a folder is loaded (runner.load_draft, once per folder) and a
    draft's vocabulary is checked against the target's (InvalidParameterError on a mismatch)."""
    check_speculative(value)
    if value is None or value == LOOKUP:
        return value
    if not is_model(value):
        load_draft = getattr(runner, "load_draft", None)
        if load_draft is None:
            raise InvalidParameterError("this runner cannot load a draft package: pass a loaded Model")
        value = load_draft(value)
    check_same_vocabulary(runner, value)
    return value


def check_same_vocabulary(target: Any, draft: Any) -> None:
    """A draft must tokenize as the target does (the same token for every id) and have as many vocabulary rows."""
    ours, theirs = getattr(target, "tokenizer", None), getattr(draft, "tokenizer", None)
    name = draft.spec.folder.name
    if ours is None or theirs is None:
        raise InvalidParameterError(f"a draft package and the model need tokenizers to be compared; {name} has none")
    try:
        checked = _same_vocabulary.setdefault(ours, weakref.WeakSet())
    except TypeError:  # a tokenizer that cannot be weakly referred to: checked every time
        checked = set()
    if theirs not in checked:
        _compare_tokens(ours, theirs, name)
        with contextlib.suppress(TypeError):
            checked.add(theirs)
    rows, theirs_rows = target.spec.arch.vocab_size, draft.spec.arch.vocab_size
    if rows != theirs_rows:  # fewer: the draft cannot take the model's tokens; more: it guesses ids the model lacks
        raise InvalidParameterError(
            f"the draft package {name} has {theirs_rows} vocabulary rows, the model {rows}: a draft must have as "
            "many (the same tokenizer and the same embedding size)"
        )


def _compare_tokens(ours: Any, theirs: Any, name: str) -> None:
    if ours.vocab_size != theirs.vocab_size:
        raise InvalidParameterError(
            f"the draft package {name} has {theirs.vocab_size} tokens, the model {ours.vocab_size}: "
            "a draft must use the same tokenizer"
        )
    for token_id in range(ours.vocab_size):
        if ours.token_text(token_id) != theirs.token_text(token_id):
            raise InvalidParameterError(
                f"the draft package {name} has token {theirs.token_text(token_id)!r} at id {token_id} where the "
                f"model has {ours.token_text(token_id)!r}: a draft must use the same tokenizer"
            )


def supports_multi_token_steps(runner: Runner) -> bool:
    """Whether a step of several tokens gives each position the logits that steps of one token give, so checking
    guesses in one step keeps the plain output (decided once per model; a warning says why not)."""
    try:
        known = _consistent.get(runner.session)
    except TypeError:  # not weakly referable: check every time
        known = None
    if known is None:
        reason = _why_not_exact(runner)
        known = reason is None
        if reason is not None:
            warnings.warn(
                f"{runner.spec.folder.name}: speculative decoding is off (plain decoding): {reason} "
                "(docs/speculative.md)",
                stacklevel=4,
            )
        with contextlib.suppress(TypeError):  # a session that cannot be weakly referred to is checked every time
            _consistent[runner.session] = known
    return known


def _why_not_exact(runner: Runner) -> str | None:
    """Why a step of several tokens would not give single steps' logits, or None. Decided from the graph: its
    logits output, and operators whose result for one row depends on how many rows a step feeds
    (row_dependent_operator). A short step check then stands guard for kernels that rule does not know."""
    if _last_token_only(runner):
        return "the graph gives the last position's logits only (exported with --last-token-logits)"
    operator = row_dependent_operator(graph_path(runner.session, runner.spec.model_path))  # the graph it runs
    if operator is not None:
        return f"{operator}, so a step of several tokens does not give the logits of single steps"
    if not _steps_agree(runner):
        return "a step of several tokens does not give the logits of single steps in this package"
    return None


def row_dependent_operator(model_path: Path) -> str | None:
    """An operator of the graph whose result for one row depends on the rows fed with it, described, or None.
    - MatMulNBits with accuracy_level >= 2 rounds activations below fp32 (4: to int8, per block) in the kernel: on
      ONNX Runtime 1.32's CPU kernels a step of one row and a step of several round some rows differently (logits
      0.01-0.8 apart, then the caches differ); at accuracy_level 0 (fp32 activations) they agree as fp32 MatMul
      does (tests/runtime/test_speculative.py, on the bundled model quantized). Levels 2 and 3 are kept plain untested.
    - DynamicQuantizeLinear / DynamicQuantizeMatMul take one activation scale over every row of a step."""
    for operator in operators(model_path):
        level = operator.ints.get("accuracy_level", 0)
        if operator.op_type == "MatMulNBits" and level >= 2:
            return f"its MatMulNBits kernels run at accuracy_level {level} (activations rounded per step's rows)"
        if operator.op_type in ("DynamicQuantizeLinear", "DynamicQuantizeMatMul"):
            return f"its {operator.op_type} quantizes activations with one scale for every row of a step"
    return None


def _last_token_only(runner: Runner) -> bool:
    if runner.spec.io.logits_to_keep:
        return False  # the fused graph: num_logits_to_keep = 0 returns every position
    for output in runner.session.get_outputs():
        if output.name == runner.spec.io.logits:
            return len(output.shape) == 3 and output.shape[1] == 1
    return False


def _steps_agree(runner: Runner) -> bool:
    """Feed a few fixed ids one at a time and then as one step after the same cache; compare the logits."""
    vocab = runner.spec.arch.vocab_size
    ids = [(7 + 131 * i) % vocab for i in range(6)]
    one = make_cache(runner, [ids[:3]], capacity=len(ids))
    one.prompt()
    singles = np.stack([one.next(np.array([[token]], dtype=np.int64))[0].copy() for token in ids[3:]])
    several = make_cache(runner, [ids[:3]], capacity=len(ids))
    several.prompt()
    together = several.extend(ids[3:], all_logits=True)
    scale = float(np.abs(singles).max()) if np.isfinite(singles).all() else 0.0
    return together.shape == singles.shape and float(np.abs(together - singles).max()) <= STEP_TOLERANCE * (1 + scale)


# ---- checking guesses ------------------------------------------------------------------------------------


def check_guesses(picker: TokenPicker, logits: np.ndarray, guesses: list[int], q) -> tuple[int, int]:
    """logits (len(guesses) + 1, V) of a round; q: the draft's distributions, one per guess, or None (a point mass).
    Returns how many guesses are accepted and the token after them. Every position is chosen by plain decoding's
    picker (runtime/sampling.py), the guesses before it `ahead`: greedy keeps a guess that is the picker's choice;
    sampling keeps it with probability min(1, p/q) and otherwise draws from max(0, p - q)."""
    for i, guess in enumerate(guesses):
        if picker.params.greedy:
            token = picker.choose(logits[i], 0, guesses[:i])
            if token != guess:
                return i, token
            continue
        p = picker.probabilities(logits[i], 0, guesses[:i])
        q_guess = 1.0 if q is None else q[i][guess]
        if picker.coin() * q_guess < p[guess]:  # accepted with probability min(1, p/q)
            continue
        residual = p.copy()
        if q is None:
            residual[guess] = 0.0
        else:
            residual = np.maximum(residual - q[i], 0.0)
        return i, picker.draw(residual) if residual.sum() > 0 else picker.draw(p)
    return len(guesses), picker.choose(logits[len(guesses)], 0, guesses)


# ---- proposing guesses -------------------------------------------------------------------------------------


class Lookup:
    """Prompt lookup: for each n-gram of the history, where the token after its latest occurrence is."""

    def __init__(self, history: list[int]):
        self.history: list[int] = []
        self.follows: dict[tuple[int, ...], int] = {}  # n-gram -> index of the token after its latest occurrence
        self.add(history)

    def add(self, tokens: list[int]) -> None:
        for token in tokens:
            self.history.append(token)
            end = len(self.history) - 1  # the new token follows the n-grams ending just before it
            for n in NGRAM_SIZES:
                if end >= n:
                    self.follows[tuple(self.history[end - n : end])] = end

    def propose(self, history: list[int], k: int) -> tuple[list[int], None]:
        self.add(history[len(self.history) :])
        for n in NGRAM_SIZES:
            start = self.follows.get(tuple(history[-n:])) if len(history) > n else None
            if start is not None:
                return history[start : start + k], None
        return [], None

    def rewind(self, kept: int) -> None:
        """Nothing to undo: only accepted tokens enter the history."""


class Draft:
    """A draft model's guesses, from its own KV cache, kept between rounds and rewound past rejected guesses."""

    def __init__(self, draft: Runner, picker: TokenPicker, *, capacity: int):
        self.draft, self.picker = draft, picker
        self.cache = make_cache(draft, [[0]], capacity=min(capacity, draft.spec.arch.context_length))
        self.cache.rewind(0)
        self.held: list[int] = []  # the ids whose keys/values the draft's cache holds

    def propose(self, history: list[int], k: int) -> tuple[list[int], list[np.ndarray] | None]:
        k = min(k, self.draft.spec.arch.context_length - len(history))
        if k <= 0:
            return [], None
        logits = self.cache.extend(history[len(self.held) :])
        self.held = list(history)
        guesses: list[int] = []
        q: list[np.ndarray] = []
        picker = self.picker  # the target's: the draft guesses as the target would choose (mask, penalty, seed)
        for i in range(k):
            if i:
                logits = self.cache.next(np.array([[guesses[-1]]], dtype=np.int64))[0]
                self.held.append(guesses[-1])
            if picker.params.greedy:
                guesses.append(picker.choose(logits, 0, guesses))
                continue
            probs = picker.probabilities(logits, 0, guesses)
            q.append(probs)
            guesses.append(picker.draw(probs))
        return guesses, (q if q else None)

    def rewind(self, kept: int) -> None:
        """Back to the draft cache's snapshot at or before `kept` (every length for a KV cache): the next
        proposal feeds the ids after it."""
        if kept < len(self.held):
            point = self.cache.rewind_point(kept)
            self.cache.rewind(point)
            self.held = self.held[:point]


@dataclass
class DraftLength:
    """How many guesses the next round makes: two more (at most MAX_DRAFT) after a round whose guesses were all
    accepted, one more than were accepted after a rejection; a round without guesses changes nothing."""

    k: int = FIRST_DRAFT
    last_proposed: int = 0  # guesses the last round made

    def update(self, proposed: int, accepted: int) -> None:
        if proposed and accepted == proposed:
            self.k = min(MAX_DRAFT, self.k + 2)
        elif proposed:
            self.k = max(1, accepted + 1)


# ---- the loop ----------------------------------------------------------------------------------------------


def speculative_decode(
    runner: Runner,
    prompt: list[int],
    state: DecodeState,
    options: GenerationOptions,
    *,
    cache: Cache | None = None,
    feed: list[int] | None = None,
) -> Iterator[tuple[int, int]]:
    """Batch-1 speculative decoding with decode()'s contract: yields (0, token id) for each new token;
    state.finish[0] says why it ended (generation.Ending's rule, as plain decoding), and the consumer may end it by
    setting state.finish[0]. On return the cache holds at most the prompt and the tokens yielded."""
    budget = options.max_new_tokens
    speculative = prepare_speculative(options.speculative, runner)
    if cache is None:
        capacity = min(len(prompt) + budget + MAX_DRAFT, runner.spec.arch.context_length)
        cache = make_cache(runner, [prompt], capacity=capacity)
    picker = TokenPicker([prompt], options.sampling, options.seed, mask=options.token_mask)
    if speculative == LOOKUP:
        proposer = Lookup(prompt)
    else:
        proposer = Draft(speculative, picker, capacity=len(prompt) + budget + MAX_DRAFT)
    ending = Ending(state, options, runner.spec.tokens.eos_token_ids)
    history, length = list(prompt), DraftLength()
    try:
        if ending.done() or ending.cancelled():
            return
        first = cache.prompt()[0] if feed is None else cache.extend(feed)
        queue = [picker.choose(first)]
        state.first_token_time = state.first_token_time or time.perf_counter()
        while True:
            token = queue.pop(0)
            if ending.is_end(0, token):
                return
            history.append(token)
            picker.append(0, token)
            yield 0, token
            ending.count(0)
            if ending.done() or ending.cancelled():
                return
            if not queue:
                queue = _round(runner, cache, picker, proposer, length, history, ending.left(0))
                state.proposed_tokens += length.last_proposed
                state.accepted_tokens += len(queue) - 1
    finally:
        if int(cache.lengths[0]) > len(history):
            cache.rewind(cache.rewind_point(len(history)))


def _round(
    runner: Runner, cache: Cache, picker: TokenPicker, proposer, length: DraftLength, history: list[int], left: int
) -> list[int]:
    """Feed the newest token and the guesses; the accepted guesses and the model's own next token. A cache that
    cannot go back to any length (a hybrid's states) goes back to its snapshot at or before the accepted length,
    and the ids from there are fed in front of the next round's: no run of its own."""
    room = runner.spec.arch.context_length - len(history)
    guesses, q = proposer.propose(history, min(length.k, left - 1, room))
    fed = history[int(cache.lengths[0]) :]  # the newest token, after a rewind to a snapshot the ids since it too
    if not guesses:
        length.last_proposed = 0
        if len(fed) == 1:
            logits = cache.next(np.array([fed], dtype=np.int64))[0]
        else:
            logits = cache.extend(fed, all_logits=True)[-1]
        return [picker.choose(logits)]
    logits = cache.extend([*fed, *guesses], all_logits=True)[len(fed) - 1 :]  # (len(guesses) + 1, V)
    accepted, token = check_guesses(picker, logits, guesses, q)
    if accepted < len(guesses):
        cache.rewind(cache.rewind_point(len(history) + accepted))
    proposer.rewind(len(history) + accepted)
    length.last_proposed = len(guesses)
    length.update(len(guesses), accepted)
    return [*guesses[:accepted], token]
