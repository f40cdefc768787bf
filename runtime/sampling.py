"""Choosing the next token from logits: small pure functions over numpy arrays, and the one picker that plain
and speculative decoding share.

The random generator is passed in (np.random.Generator), so a seed reproduces a run. Greedy is an
explicit branch, never a division by a tiny temperature. Order of operations, as in Hugging Face
and gpt-fast: a token mask (TokenMask, e.g. a grammar's) on the model's logits, then the repetition
penalty, then temperature, then top-k, top-p and min-p filtering (`distribution`), then one draw from
the renormalised distribution (`draw`). Speculative decoding (runtime/speculative.py) checks guesses
against the same `distribution` (gpt-fast's speculative_decode reuses its logits_to_probs likewise).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from .errors import InvalidInputError, InvalidParameterError, non_finite_logits


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 = greedy (argmax); otherwise logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 = no limit
    top_p: float = 1.0  # keep the smallest set of tokens whose probability reaches top_p
    min_p: float = 0.0  # drop tokens less likely than min_p times the most likely one
    repetition_penalty: float = 1.0  # > 1 discourages tokens already in the prompt or output

    def __post_init__(self) -> None:
        check_params(self.temperature, self.top_k, self.top_p, self.min_p, self.repetition_penalty)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1


def _is_number(x: object) -> bool:
    return isinstance(x, (int, float, np.integer, np.floating)) and not isinstance(x, bool)


def _is_finite(x: object) -> bool:
    try:
        return _is_number(x) and math.isfinite(x)
    except OverflowError:  # an int beyond float's range (np.isfinite raises TypeError for it)
        return False


def check_params(temperature: float, top_k: int, top_p: float, min_p: float, repetition_penalty: float) -> None:
    """Raise InvalidParameterError naming the first parameter out of its range."""
    if not _is_finite(temperature) or temperature < 0:
        raise InvalidParameterError(f"temperature must be a finite number >= 0, got {temperature!r}")
    if isinstance(top_k, bool) or not isinstance(top_k, (int, np.integer)) or top_k < 0:
        raise InvalidParameterError(f"top_k must be an integer >= 0 (0 = off), got {top_k!r}")
    if not _is_number(top_p) or not 0.0 < top_p <= 1.0:
        raise InvalidParameterError(f"top_p must be in (0, 1], got {top_p!r}")
    if not _is_number(min_p) or not 0.0 <= min_p < 1.0:
        raise InvalidParameterError(f"min_p must be in [0, 1), got {min_p!r}")
    if not _is_finite(repetition_penalty) or repetition_penalty <= 0:
        raise InvalidParameterError(f"repetition_penalty must be a finite number > 0, got {repetition_penalty!r}")


def apply_repetition_penalty(logits: np.ndarray, seen: np.ndarray, penalty: float) -> np.ndarray:
    """CTRL's penalty (Keskar et al. 2019): a seen token's positive logit is divided by the penalty,
    a negative one multiplied, so the token always becomes less likely. logits (V,), seen: token ids."""
    if penalty == 1.0 or len(seen) == 0:
        return logits
    logits = logits.copy()
    ids = np.unique(seen)
    scores = logits[ids].astype(np.float64)  # float64: a penalty of 5e-324 is not 0 there
    with np.errstate(over="ignore", under="ignore"):  # a penalty of 1e-45 or 1e300: clipped below
        penalized = np.where(scores > 0, scores / penalty, scores * penalty)
    top = np.finfo(logits.dtype).max  # a finite logit stays finite: inf - inf in softmax would make NaN
    logits[ids] = np.where(np.isfinite(scores), np.clip(penalized, -top, top), scores)
    return logits


def finite_logits(logits: np.ndarray) -> np.ndarray:
    """Logits the samplers can work with: +inf becomes the largest finite value (that token is the
    most likely one), -inf stays (probability 0); NaN, or no token with a finite chance, is refused."""
    if np.isnan(logits).any():
        raise InvalidInputError("the logits hold NaN: no token can be chosen")
    if not np.isfinite(logits).all():
        if np.isneginf(logits).all():
            raise InvalidInputError("every logit is -inf: no token can be chosen")
        logits = np.minimum(logits, np.finfo(logits.dtype).max)
    return logits


def top_k_filter(logits: np.ndarray, k: int) -> np.ndarray:
    """Keep the k largest logits, set the rest to -inf. Ties at the k-th value are all kept."""
    k = int(k)
    if k <= 0 or k >= logits.shape[-1]:
        return logits
    return np.where(logits >= _kth_largest(logits, k), logits, -np.inf)


def _kth_largest(logits: np.ndarray, k: int) -> float:
    return np.partition(logits, -int(k))[-int(k)]  # int(): a numpy unsigned k (np.uint64) would not negate


def softmax(logits: np.ndarray) -> np.ndarray:
    z = logits - np.max(logits)
    e = np.exp(z)
    return e / e.sum()


def top_p_filter(logits: np.ndarray, p: float) -> np.ndarray:
    """Nucleus filtering (Holtzman et al. 2019): keep the smallest set of most likely tokens whose
    probability mass reaches p; the most likely token is always kept."""
    if p >= 1.0:
        return logits
    order = np.argsort(-logits, kind="stable")
    cumulative = np.cumsum(softmax(logits)[order])
    keep = int(np.searchsorted(cumulative, p, side="left")) + 1  # first index where mass >= p, inclusive
    filtered = np.full_like(logits, -np.inf)
    filtered[order[:keep]] = logits[order[:keep]]
    return filtered


def min_p_filter(logits: np.ndarray, min_p: float) -> np.ndarray:
    """Drop tokens whose probability is below min_p times the top token's probability."""
    if min_p <= 0.0:
        return logits
    threshold = np.max(logits) + np.log(min_p)  # p_i >= min_p * p_max  <=>  l_i >= l_max + log(min_p)
    return np.where(logits >= threshold, logits, -np.inf)


def _prepared(logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None) -> np.ndarray:
    """Finite logits in the precision the transforms run in, after the repetition penalty. float32: exp and
    cumsum over a 50k vocabulary cost several times more in float64, and a draw needs no more precision
    (temperatures too small or too large for float32 to divide by take float64)."""
    in_float32_range = 1e-30 <= params.temperature <= 1e30  # else T itself would round to 0 or inf
    logits = finite_logits(logits.astype(np.float32 if in_float32_range else np.float64, copy=False))
    if seen is not None:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return logits


def distribution(
    logits: np.ndarray, params: SamplingParams, seen: np.ndarray | None = None
) -> tuple[np.ndarray | None, np.ndarray]:
    """The distribution sampling draws from, after every transform: (ids, probs), the tokens that can be drawn
    (ascending) and their probabilities, or (None, probs) over the whole vocabulary. Greedy: the argmax, 1.0."""
    logits = _prepared(logits, params, seen)
    if params.greedy:
        return np.array([int(np.argmax(logits))]), np.ones(1, dtype=logits.dtype)
    # shift the largest logit to 0 before dividing: a tiny temperature then sends the others to -inf
    # (probability 0) instead of the largest to inf, which softmax would turn into NaN (inf - inf)
    with np.errstate(over="ignore"):
        logits = (logits - np.max(logits)) / params.temperature
    # Work on the few tokens that can still be drawn (ids in ascending order, so a draw picks the same token
    # as over the whole vocabulary): with a 50k vocabulary, sorting all of it for top-p or renormalising it
    # for every draw would cost more than a decode step's Python loop.
    # (_candidates applies top-k itself, keeping ties as top_k_filter does)
    ids = _candidates(logits, params)
    if ids is not None:
        logits = logits[ids]
    logits = top_p_filter(logits, params.top_p)
    logits = min_p_filter(logits, params.min_p)
    return ids, softmax(logits)


def dense(ids: np.ndarray | None, probs: np.ndarray, vocab: int) -> np.ndarray:
    """distribution()'s result as probabilities over the whole vocabulary, (vocab,)."""
    if ids is None:
        return probs
    full = np.zeros(vocab, dtype=probs.dtype)
    full[ids] = probs
    return full


def draw(probs: np.ndarray, rng: np.random.Generator) -> int:
    """An index into probs (which need not sum to 1), with one uniform number: an inverse-CDF draw (llama2.c's
    sample_mult), so a seed reproduces it."""
    coin = rng.random()
    return min(int(np.searchsorted(np.cumsum(probs), coin * probs.sum(), side="right")), len(probs) - 1)


def sample(logits: np.ndarray, params: SamplingParams, rng: np.random.Generator, seen: np.ndarray | None = None) -> int:
    """One token id from one row of logits (V,): the argmax when greedy, else a draw from distribution()."""
    if params.greedy:
        return int(np.argmax(_prepared(logits, params, seen)))
    ids, probs = distribution(logits, params, seen)
    index = draw(probs, rng)
    return int(ids[index]) if ids is not None else index


NUCLEUS_CANDIDATES = 1024  # top-p first looks for its set among this many most likely tokens


def _candidates(logits: np.ndarray, params: SamplingParams) -> np.ndarray | None:
    """Ids (ascending) of every token that top-k or top-p can keep, when that is a small part of the
    vocabulary; None when it is not (then the filters run on the whole vocabulary). Ties at the cut
    are all included, as top_k_filter keeps them, so the result equals filtering everything."""
    vocab, k = logits.shape[-1], int(params.top_k)
    if 0 < k < vocab:
        return np.flatnonzero(logits >= _kth_largest(logits, k))
    if params.top_p < 1.0 and vocab > 2 * NUCLEUS_CANDIDATES:
        ids = np.flatnonzero(logits >= _kth_largest(logits, NUCLEUS_CANDIDATES))
        weights = np.exp(logits)  # the largest logit is 0 here
        if weights[ids].sum() >= params.top_p * weights.sum():  # the nucleus lies among them
            return ids
    return None


# ---- the picker --------------------------------------------------------------------------------------------

# A token mask: (row, the ids this generation has chosen for that row before the position, that position's logits
# (V,)) -> logits (V,) with every token that may not come next at -inf (a new array; the given one is read-only).
# It is applied to the model's logits before anything else, for greedy and sampled choices, plain decoding,
# speculative verification of every guessed position and a draft's guesses alike (a grammar's token mask).
TokenMask = Callable[[int, Sequence[int], np.ndarray], np.ndarray]


class TokenPicker:
    """Chooses tokens from logits for every row of a generation, plain and speculative decoding alike: one seeded
    generator per row (seed + row), each row's ids so far (for the repetition penalty and the token mask), and a
    single argmax pass when decoding is greedy without a penalty or a mask.

    A position is one row's next one, or, with `ahead`, the one after tokens not yet chosen (speculative
    decoding's guesses before it). Non-finite logits from the model raise PackageError (errors.non_finite_logits)."""

    def __init__(
        self, prompts: list[list[int]], params: SamplingParams, seed: int | None, *, mask: TokenMask | None = None
    ):
        self.params, self.mask = params, mask
        self.rngs = [np.random.default_rng(None if seed is None else seed + row) for row in range(len(prompts))]
        self.penalize = params.repetition_penalty != 1.0
        self.seen = [np.array(p, dtype=np.int64) for p in prompts] if self.penalize else []
        self.generated: list[list[int]] = [[] for _ in prompts]  # the ids chosen (and kept) so far, per row
        self.argmax_only = params.greedy and not self.penalize and mask is None  # one pass over the logits

    def append(self, row: int, token: int) -> None:
        """`token` is row's next id: later positions come after it."""
        self.generated[row].append(token)
        if self.penalize:
            self.seen[row] = np.append(self.seen[row], token)

    def pick(self, logits: np.ndarray, live: list[int]) -> list[int]:
        """logits (B, V) of a step; the next token of each row in `live`, in order."""
        rows = logits[live] if len(logits) > 1 else logits
        if self.argmax_only:
            # argmax returns a NaN's index if there is one, and +inf's before any finite value, so the chosen
            # logits are finite exactly when the pick is sound (a -inf beside finite logits cannot change it);
            # this replaces a second pass over the vocabulary for the check
            picks = rows.argmax(axis=-1)
            if not np.isfinite(rows[np.arange(len(rows)), picks]).all():
                raise non_finite_logits()
            return [int(token) for token in picks]
        if not np.isfinite(rows).all():
            raise non_finite_logits()
        return [self._choose(rows[i], row, ()) for i, row in enumerate(live)]

    def choose(self, logits: np.ndarray, row: int = 0, ahead: Sequence[int] = ()) -> int:
        """The token at one position from its logits (V,), as pick() would choose it there."""
        if self.argmax_only:
            token = int(np.argmax(logits))
            checked = logits[token : token + 1]  # finite exactly when the pick is sound (see pick)
        else:
            token, checked = -1, logits
        if not np.isfinite(checked).all():
            raise non_finite_logits()
        return token if token >= 0 else self._choose(logits, row, ahead)

    def probabilities(self, logits: np.ndarray, row: int = 0, ahead: Sequence[int] = ()) -> np.ndarray:
        """The distribution pick() samples from at one position, (V,): speculative decoding's p and a draft's q."""
        if not np.isfinite(logits).all():
            raise non_finite_logits()
        ids, probs = distribution(self._masked(logits, row, ahead), self.params, self._seen(row, ahead))
        return dense(ids, probs, logits.shape[-1])

    def draw(self, probs: np.ndarray, row: int = 0) -> int:
        """A token from probabilities over the vocabulary, with row's generator."""
        return draw(probs, self.rngs[row])

    def coin(self, row: int = 0) -> float:
        """A uniform number in [0, 1) from row's generator (speculative decoding's acceptance test)."""
        return self.rngs[row].random()

    def _choose(self, logits: np.ndarray, row: int, ahead: Sequence[int]) -> int:
        return sample(self._masked(logits, row, ahead), self.params, self.rngs[row], self._seen(row, ahead))

    def _masked(self, logits: np.ndarray, row: int, ahead: Sequence[int]) -> np.ndarray:
        if self.mask is None:
            return logits
        return self.mask(row, [*self.generated[row], *ahead], logits)

    def _seen(self, row: int, ahead: Sequence[int]) -> np.ndarray | None:
        if not self.penalize:
            return None
        return np.concatenate([self.seen[row], np.asarray(ahead, dtype=np.int64)]) if len(ahead) else self.seen[row]
