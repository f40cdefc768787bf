"""Sampling on fixed logits: the pure functions of runtime/sampling.py, checked set by set and, for
the random draws, statistically (chi-square goodness of fit at significance 0.001, fixed seeds)."""

from __future__ import annotations

import numpy as np
import pytest

from edgelm.runtime import InvalidParameterError, SamplingParams
from edgelm.runtime.sampling import (
    apply_repetition_penalty,
    min_p_filter,
    sample,
    softmax,
    top_k_filter,
    top_p_filter,
)

DRAWS = 20_000
SIGNIFICANCE = 0.001  # a correct sampler fails a test at most once in a thousand seeds

# probabilities that are exact binary fractions, so the top-p / min-p boundaries are exact in floating point
DYADIC = np.array([0.0625, 0.5, 0.125, 0.0625, 0.25])  # deliberately not sorted: token 1 is the most likely
DYADIC_LOGITS = np.log(DYADIC)


def kept(logits: np.ndarray) -> set[int]:
    return set(np.flatnonzero(np.isfinite(logits)).tolist())


def draw_counts(logits: np.ndarray, params: SamplingParams, *, seed: int = 0, draws: int = DRAWS) -> np.ndarray:
    rng = np.random.default_rng(seed)
    counts = np.zeros(len(logits), dtype=np.int64)
    for _ in range(draws):
        counts[sample(logits, params, rng)] += 1
    return counts


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of the observed counts under the expected probabilities (zero-probability cells excluded)."""
    stats = pytest.importorskip("scipy.stats")
    support = probs > 0
    expected = probs[support] / probs[support].sum() * counts.sum()
    return float(stats.chisquare(counts[support], expected).pvalue)


@pytest.fixture
def logits() -> np.ndarray:
    return np.random.default_rng(42).normal(0.0, 2.0, size=50)


# ---- greedy ---------------------------------------------------------------------------------------


def test_temperature_zero_is_argmax(logits):
    rng = np.random.default_rng(0)
    for row in np.random.default_rng(1).normal(size=(200, 50)):
        assert sample(row, SamplingParams(temperature=0.0), rng) == int(np.argmax(row))
    # top_k=1 is greedy too, whatever the temperature
    assert sample(logits, SamplingParams(temperature=5.0, top_k=1), rng) == int(np.argmax(logits))


def test_tiny_temperature_approaches_argmax(logits):
    counts = draw_counts(logits, SamplingParams(temperature=1e-3), draws=500)
    assert counts[np.argmax(logits)] == 500


@pytest.mark.parametrize("temperature", [1e-307, 1e-310, 5e-324])
def test_temperature_too_small_to_divide_by_still_gives_argmax(temperature):
    """logits / T overflows to inf here; the sampler must not turn that into NaN probabilities."""
    rng = np.random.default_rng(0)
    for logits in (np.array([1.0, 3.0, 2.0, -1.0]), np.array([-400.0, 300.0, 299.0])):
        assert sample(logits, SamplingParams(temperature=temperature), rng) == int(np.argmax(logits))


# ---- temperature and the full distribution --------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_draws_follow_softmax_over_temperature(temperature):
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    counts = draw_counts(logits, SamplingParams(temperature=temperature), seed=int(temperature * 10))
    assert chi_square_p(counts, softmax(logits / temperature)) > SIGNIFICANCE


def test_draws_are_not_plain_softmax_when_temperature_differs():
    """The chi-square test has power: draws at T=2 are rejected against softmax(logits / 1)."""
    logits = np.array([2.0, 1.0, 0.5, 0.0, -1.0, -3.0])
    counts = draw_counts(logits, SamplingParams(temperature=2.0))
    assert chi_square_p(counts, softmax(logits)) < SIGNIFICANCE


# ---- top-k ----------------------------------------------------------------------------------------


def test_top_k_filter_keeps_the_k_largest(logits):
    for k in (1, 3, 10):
        assert kept(top_k_filter(logits, k)) == set(np.argsort(-logits)[:k].tolist())
    assert kept(top_k_filter(logits, 0)) == set(range(50))  # 0 = off
    assert kept(top_k_filter(logits, 500)) == set(range(50))  # k beyond the vocabulary = off


def test_top_k_filter_keeps_all_ties_at_the_kth_value():
    assert kept(top_k_filter(np.array([3.0, 1.0, 2.0, 2.0, 0.0]), 2)) == {0, 2, 3}


def test_top_k_never_samples_outside_the_k_best(logits):
    k = 5
    best = np.argsort(-logits)[:k]
    counts = draw_counts(logits, SamplingParams(temperature=3.0, top_k=k), seed=3)
    assert set(np.flatnonzero(counts).tolist()) <= set(best.tolist())
    allowed = np.zeros_like(logits)
    allowed[best] = softmax(logits[best] / 3.0)
    assert chi_square_p(counts, allowed) > SIGNIFICANCE


# ---- top-p ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("p", "expected"),
    [
        (0.01, {1}),  # the most likely token alone already has more than p: it is always kept
        (0.5, {1}),  # exactly reaches p: one token is enough
        (0.5000001, {1, 4}),  # just over: the next token is needed
        (0.75, {1, 4}),
        (0.76, {1, 4, 2}),
        (0.875, {1, 4, 2}),
        (0.9375, {1, 4, 2, 0}),  # ties at 0.0625: the lower index comes first
        (1.0, {0, 1, 2, 3, 4}),
    ],
)
def test_top_p_keeps_the_smallest_set_reaching_p(p, expected):
    assert kept(top_p_filter(DYADIC_LOGITS, p)) == expected


def test_top_p_keeps_logits_unchanged():
    filtered = top_p_filter(DYADIC_LOGITS, 0.8)
    for i in kept(filtered):
        assert filtered[i] == DYADIC_LOGITS[i]


def test_top_p_draws_follow_the_renormalised_nucleus():
    counts = draw_counts(DYADIC_LOGITS, SamplingParams(temperature=1.0, top_p=0.8), seed=5)
    assert counts[0] == counts[3] == 0
    nucleus = np.where(np.isin(np.arange(5), [1, 4, 2]), DYADIC, 0.0)
    assert chi_square_p(counts, nucleus) > SIGNIFICANCE


def test_top_p_applies_after_temperature():
    """At T=2 the distribution flattens, so p=0.5 needs more than the top token."""
    assert kept(top_p_filter(DYADIC_LOGITS / 2.0, 0.5)) == {1, 4}
    counts = draw_counts(DYADIC_LOGITS, SamplingParams(temperature=2.0, top_p=0.5), seed=6, draws=2000)
    assert set(np.flatnonzero(counts).tolist()) == {1, 4}


# ---- min-p ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("min_p", "expected"),
    [
        (0.0, {0, 1, 2, 3, 4}),  # off
        (0.125, {0, 1, 2, 3, 4}),  # 0.0625 = 0.125 * 0.5 exactly: kept
        (0.126, {1, 2, 4}),
        (0.25, {1, 2, 4}),
        (0.5, {1, 4}),
        (0.9, {1}),
    ],
)
def test_min_p_drops_tokens_below_a_fraction_of_the_top(min_p, expected):
    assert kept(min_p_filter(DYADIC_LOGITS, min_p)) == expected


def test_min_p_draws_follow_the_remaining_tokens():
    counts = draw_counts(DYADIC_LOGITS, SamplingParams(temperature=1.0, min_p=0.3), seed=7)
    remaining = np.where(np.isin(np.arange(5), [1, 4]), DYADIC, 0.0)
    assert counts.sum() == counts[1] + counts[4]
    assert chi_square_p(counts, remaining) > SIGNIFICANCE


# ---- repetition penalty ---------------------------------------------------------------------------


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = np.array([2.0, -2.0, 1.0, -1.0])
    out = apply_repetition_penalty(logits, np.array([0, 1, 1]), 2.0)
    assert out.tolist() == [1.0, -4.0, 1.0, -1.0]  # a token seen twice is penalised once
    assert logits.tolist() == [2.0, -2.0, 1.0, -1.0]  # the input is not modified


def test_repetition_penalty_makes_seen_tokens_less_likely_whatever_their_sign():
    rng = np.random.default_rng(0)
    penalise = SamplingParams(repetition_penalty=1.5)
    assert sample(np.array([2.0, 1.5]), penalise, rng, seen=np.array([0])) == 1  # 2.0 / 1.5 < 1.5
    assert sample(np.array([-1.0, -1.4]), penalise, rng, seen=np.array([0])) == 1  # -1.0 * 1.5 < -1.4
    assert sample(np.array([2.0, 1.5]), SamplingParams(), rng, seen=np.array([0])) == 0  # penalty 1 = off
    encourage = SamplingParams(repetition_penalty=0.5)
    assert sample(np.array([1.0, 1.5]), encourage, rng, seen=np.array([0])) == 0  # a penalty < 1 favours repeats


def test_repetition_penalty_without_history_is_a_no_op():
    logits = np.array([1.0, -1.0])
    assert apply_repetition_penalty(logits, np.array([], dtype=np.int64), 3.0).tolist() == [1.0, -1.0]


# ---- seeds ----------------------------------------------------------------------------------------


def test_same_seed_same_tokens_different_seed_different_tokens(logits):
    params = SamplingParams(temperature=1.0, top_k=20, top_p=0.95)

    def run(seed: int) -> list[int]:
        rng = np.random.default_rng(seed)
        return [sample(logits, params, rng) for _ in range(50)]

    assert run(1) == run(1)
    assert run(1) != run(2)


# ---- parameter validation -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "bad",
    [
        dict(temperature=-0.1),
        dict(temperature=float("nan")),
        dict(temperature=float("inf")),
        dict(top_k=-1),
        dict(top_k=2.5),
        dict(top_p=0.0),
        dict(top_p=1.01),
        dict(min_p=-0.1),
        dict(min_p=1.0),
        dict(repetition_penalty=0.0),
        dict(repetition_penalty=-1.0),
        dict(temperature="0.7"),
    ],
)
def test_invalid_parameters_raise_and_name_the_parameter(bad):
    with pytest.raises(InvalidParameterError, match=next(iter(bad))):
        SamplingParams(**bad)
