"""Speculative decoding: guess several next tokens cheaply, check them all in one run of the model.

Each round feeds the newest token and k guessed ones as one multi-token step (logits for every position),
keeps the longest run of guesses the model agrees with plus the model's own next token, and rewinds the KV
cache past the rest. Two ways to guess (speculative= in generate/stream/chat/conversation):

- "lookup": prompt lookup decoding (Saxena 2023; llama.cpp's lookup): the longest of the last n tokens
  (n in NGRAM_SIZES) that occurred before, in the prompt or the output, proposes the tokens that followed it;
- a draft Model (or package folder) with the same tokenizer, which proposes k tokens from its own kept cache.

Greedy output is the plain greedy output, token for token. With sampling, a guess x is accepted with
probability min(1, p(x)/q(x)) and a rejection draws from max(0, p - q), normalised (Leviathan et al. 2023,
Chen et al. 2023), so every token is distributed as plain sampling's p; lookup's q is a point mass. p is the
target's distribution after the same repetition penalty, temperature and top-k/top-p/min-p as plain sampling.
k adapts: it grows while guesses are accepted and shrinks on a rejection; no guess makes a plain step.
A batch of several prompts decodes plainly (runtime/decode.py).
"""

from __future__ import annotations

import contextlib
import os
import time
import warnings
import weakref
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from .constraints import matchers
from .errors import InvalidParameterError, non_finite_logits
from .kvcache import make_cache
from .sampling import (
    SamplingParams,
    apply_repetition_penalty,
    finite_logits,
    min_p_filter,
    sample,
    softmax,
    top_k_filter,
    top_p_filter,
)

if TYPE_CHECKING:
    from .runner import Runner

LOOKUP = "lookup"
NGRAM_SIZES = (3, 2)  # prompt lookup matches the last 3 tokens, else the last 2 (one token matches too often)
MAX_DRAFT = 10  # guesses per round at most
FIRST_DRAFT = 4  # guesses in the first round
STEP_TOLERANCE = 1e-3  # logits of a multi-token step may differ from one-token steps' by this, relative
# Checked once per model. Keyed by what a model shares with its adapters' runners (runtime/adapters.py), which
# are made per request: the tokenizer and the ONNX Runtime session.
_same_vocabulary: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # tokenizer -> draft tokenizers it matches
_consistent: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # session -> supports_multi_token_steps


def check_speculative(value: Any) -> None:
    """InvalidParameterError unless value is None, "lookup", a loaded model or an existing package folder."""
    if value is None or value == LOOKUP or _is_model(value):
        return
    if isinstance(value, (str, os.PathLike)) and os.path.isdir(value):
        return
    raise InvalidParameterError(
        f"speculative must be 'lookup', a draft Model, a package folder or None, got {value!r}"
        + (" (no such folder)" if isinstance(value, (str, os.PathLike)) else "")
    )


def _is_model(value: Any) -> bool:
    return all(hasattr(value, name) for name in ("spec", "session", "tokenizer", "run"))


def prepare_speculative(value: Any, runner: Runner) -> Any:
    """The speculative option ready to decode with: a folder is loaded (runner.load_draft, once per folder) and a
    draft's vocabulary is checked against the target's (InvalidParameterError on a mismatch)."""
    check_speculative(value)
    if value is None or value == LOOKUP:
        return value
    if not _is_model(value):
        load_draft = getattr(runner, "load_draft", None)
        if load_draft is None:
            raise InvalidParameterError("this runner cannot load a draft package: pass a loaded Model")
        value = load_draft(value)
    check_same_vocabulary(runner, value)
    return value


def check_same_vocabulary(target: Any, draft: Any) -> None:
    """A draft must tokenize as the target does: the same token for every id."""
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
    if draft.spec.arch.vocab_size > target.spec.arch.vocab_size:
        raise InvalidParameterError(f"the draft package {name} has a larger vocabulary than the model")


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
    """Whether a step of several tokens gives each position the logits that steps of one token give (checked once
    per model). A graph exported with last-token logits only cannot check guesses; and int4/int8 MatMulNBits with
    accuracy_level 4 quantize activations differently for one row than for several (logits apart by ~0.5 on
    SmolLM2), which would change greedy output: those packages decode plainly (README, "Speculative decoding")."""
    try:
        known = _consistent.get(runner.session)
    except TypeError:  # not weakly referable: check every time
        known = None
    if known is None:
        known = not _last_token_only(runner) and _steps_agree(runner)
        if not known:
            warnings.warn(
                f"{runner.spec.folder.name}: speculative decoding is off (plain decoding): a step of several tokens "
                "does not give the logits of single steps in this package (README, 'Speculative decoding')",
                stacklevel=4,
            )
        with contextlib.suppress(TypeError):  # a session that cannot be weakly referred to is checked every time
            _consistent[runner.session] = known
    return known


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


# ---- choosing and checking tokens ------------------------------------------------------------------------


def probabilities(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None) -> np.ndarray:
    """The distribution plain sampling draws from (runtime/sampling.py's order of transforms), (V,) float64."""
    logits = finite_logits(logits.astype(np.float64))
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    with np.errstate(over="ignore"):
        logits = (logits - np.max(logits)) / params.temperature
    logits = min_p_filter(top_p_filter(top_k_filter(logits, params.top_k), params.top_p), params.min_p)
    return softmax(logits)


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """One token from a distribution (probs need not sum to 1): an inverse-CDF draw with one uniform number."""
    cumulative = np.cumsum(probs)
    return min(int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right")), len(probs) - 1)


class Chooser:
    """The target's choices: plain sampling for a step without guesses, and the acceptance rule for a round."""

    def __init__(self, params: SamplingParams, seed: int | None, constrained=None):
        self.params = params
        self.rng = np.random.default_rng(seed)  # row 0 of a batch: seed + 0
        self.penalize = params.repetition_penalty != 1.0
        self.matcher = constrained[0] if constrained else None  # a grammar's mask (runtime/constraints.py)
        self.masked = constrained is not None  # logits may hold the mask's -inf (checked before masking)

    def _sound(self, logits: np.ndarray) -> bool:
        return bool(np.isfinite(logits).all()) or (self.masked and not np.isnan(logits).any())

    def seen(self, history: list[int]) -> np.ndarray | None:
        return np.array(history, dtype=np.int64) if self.penalize else None

    def choose(self, logits: np.ndarray, history: list[int]) -> int:
        """One token from one position's logits (V,), as plain decoding (decode.py's TokenPicker) picks it; with a
        grammar, the token is taken by it."""
        if self.matcher is None:
            return self._choose(logits, history)
        if not np.isfinite(logits).all():  # checked before the mask adds its -inf
            raise non_finite_logits()
        matcher, self.matcher = self.matcher, None
        try:
            token = self._choose(matcher.mask(logits), history)
        finally:
            self.matcher = matcher
        matcher.take(token)
        return token

    def _choose(self, logits: np.ndarray, history: list[int]) -> int:
        if self.params.greedy and not self.penalize:
            token = int(np.argmax(logits))
            checked = logits[token : token + 1]  # finite exactly when the pick is sound (see TokenPicker.pick)
        else:
            token, checked = -1, logits
        if not self._sound(checked):
            raise non_finite_logits()
        return token if token >= 0 else sample(logits, self.params, self.rng, self.seen(history))

    def check(self, logits: np.ndarray, history: list[int], guesses: list[int], q) -> tuple[int, int]:
        """logits (len(guesses) + 1, V) of a round; q: the draft's distributions, one per guess, or None (a
        point mass). Returns how many guesses are accepted and the token after them. With a grammar, every
        position is masked as plain decoding would mask it, and the grammar takes the chosen tokens."""
        if self.matcher is None:
            return self._check(logits, history, guesses, q)
        if not np.isfinite(logits).all():  # checked before the masks add their -inf
            raise non_finite_logits()
        matcher, self.matcher = self.matcher, None  # the round's masks are made here, once
        try:
            accepted, token = self._check(matcher.mask_round(logits, guesses), history, guesses, q)
        finally:
            self.matcher = matcher
        for taken in [*guesses[:accepted], token]:
            matcher.take(taken)
        return accepted, token

    def _check(self, logits: np.ndarray, history: list[int], guesses: list[int], q) -> tuple[int, int]:
        if self.params.greedy and not self.penalize:  # one argmax pass over every position
            picks = logits.argmax(axis=-1)
            agree = picks[: len(guesses)] == np.array(guesses, dtype=picks.dtype)
            accepted = len(guesses) if agree.all() else int(np.argmin(agree))
            if not np.isfinite(logits[np.arange(accepted + 1), picks[: accepted + 1]]).all():
                raise non_finite_logits()
            return accepted, int(picks[accepted])
        for i, guess in enumerate(guesses):
            seen = history + guesses[:i]
            if self.params.greedy:
                token = self.choose(logits[i], seen)
                if token != guess:
                    return i, token
                continue
            if not self._sound(logits[i]):
                raise non_finite_logits()
            p = probabilities(logits[i], self.params, self.seen(seen))
            q_guess = 1.0 if q is None else q[i][guess]
            if self.rng.random() * q_guess < p[guess]:  # accepted with probability min(1, p/q)
                continue
            residual = p.copy()
            if q is None:
                residual[guess] = 0.0
            else:
                residual = np.maximum(residual - q[i], 0.0)
            return i, draw(residual, self.rng) if residual.sum() > 0 else draw(p, self.rng)
        return len(guesses), self.choose(logits[len(guesses)], history + guesses)


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

    def __init__(self, draft: Runner, chooser: Chooser, *, capacity: int):
        self.draft, self.chooser = draft, chooser
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
        params = self.chooser.params
        for i in range(k):
            if i:
                logits = self.cache.next(np.array([[guesses[-1]]], dtype=np.int64))[0]
                self.held.append(guesses[-1])
            if params.greedy:
                guesses.append(sample(logits, params, self.chooser.rng, self.chooser.seen(history + guesses)))
                continue
            probs = probabilities(logits, params, self.chooser.seen(history + guesses))
            q.append(probs)
            guesses.append(draw(probs, self.chooser.rng))
        return guesses, (q if q else None)

    def rewind(self, kept: int) -> None:
        if kept < len(self.held):
            self.cache.rewind(kept)
            self.held = self.held[:kept]


@dataclass
class DraftLength:
    """How many guesses the next round makes: one more after a round whose guesses were all accepted, one more
    than were accepted after a rejection."""

    k: int = FIRST_DRAFT
    last_proposed: int = 0  # guesses the last round made

    def update(self, proposed: int, accepted: int) -> None:
        if proposed and accepted == proposed:
            self.k = min(MAX_DRAFT, self.k + 2)
        elif proposed:
            self.k = max(1, accepted + 1)


# ---- the loop ----------------------------------------------------------------------------------------------


def _q_for(probs, vocab: int):
    """A draft's distributions padded to the target's vocabulary (a draft may have a smaller one)."""
    if probs is None:
        return None
    return [np.pad(p, (0, vocab - len(p))) if len(p) < vocab else p for p in probs]


def speculative_decode(
    runner: Runner, prompt: list[int], state, options, *, cache=None, feed=None
) -> Iterator[tuple[int, int]]:
    """Batch-1 speculative decoding with decode()'s contract: yields (0, token id) for each new token;
    state.finish[0] says why it ended, and the consumer may end it by setting state.finish[0]. On return the
    cache holds at most the prompt and the tokens yielded."""
    budget, cancel = options.max_new_tokens, options.cancel
    speculative = prepare_speculative(options.speculative, runner)
    if cache is None:
        capacity = min(len(prompt) + budget + MAX_DRAFT, runner.spec.arch.context_length)
        cache = make_cache(runner, [prompt], capacity=capacity)
    chooser = Chooser(options.sampling, options.seed, constrained=matchers(runner, options.constraint, 1))
    if speculative == LOOKUP:
        proposer = Lookup(prompt)
    else:
        proposer = Draft(speculative, chooser, capacity=len(prompt) + budget + MAX_DRAFT)
    eos = set() if options.ignore_eos else set(runner.spec.tokens.eos_token_ids)
    history, length = list(prompt), DraftLength()
    try:
        if budget == 0 or (cancel is not None and cancel.is_set()):
            state.finish[0] = "cancelled" if budget else "length"
            return
        first = cache.prompt()[0] if feed is None else cache.extend(feed)
        queue = [chooser.choose(first, history)]
        state.first_token_time = state.first_token_time or time.perf_counter()
        while True:
            token = queue.pop(0)
            if token in eos:
                state.finish[0] = "eos"
                return
            history.append(token)
            yield 0, token
            if state.finish[0]:
                return
            if len(history) - len(prompt) == budget:
                state.finish[0] = "length"
                return
            if cancel is not None and cancel.is_set():
                state.finish[0] = "cancelled"
                return
            if not queue:
                queue = _round(runner, cache, chooser, proposer, length, history, budget - len(history) + len(prompt))
                state.proposed_tokens += length.last_proposed
                state.accepted_tokens += len(queue) - 1
    finally:
        if int(cache.lengths[0]) > len(history):
            cache.rewind(len(history))


def _round(runner, cache, chooser: Chooser, proposer, length: DraftLength, history: list[int], left: int) -> list[int]:
    """Feed the newest token and the guesses; the accepted guesses and the model's own next token."""
    room = runner.spec.arch.context_length - len(history)
    guesses, q = proposer.propose(history, min(length.k, left - 1, room))
    if not guesses:
        length.last_proposed = 0
        logits = cache.next(np.array([[history[-1]]], dtype=np.int64))
        return [chooser.choose(logits[0], history)]
    logits = cache.extend([history[-1], *guesses], all_logits=True)  # (len(guesses) + 1, V)
    accepted, token = chooser.check(logits, history, guesses, _q_for(q, logits.shape[-1]))
    if accepted < len(guesses):
        cache.rewind(len(history) + accepted)
    proposer.rewind(len(history) + accepted)
    length.last_proposed = len(guesses)
    length.update(len(guesses), accepted)
    return [*guesses[:accepted], token]
