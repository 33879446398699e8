"""The one-run audit statistics: published values, an independent computation, monotonicity, soundness by simulation
and input checks. The references are exact fractions and seeded simulations: no scipy."""

from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest

from lightning_longshield.audit import (
    AuditResult,
    audit_p_value,
    best_epsilon_lower_bound,
    binomial_upper_tail,
    count_correct_guesses,
    epsilon_lower_bound,
)
from lightning_longshield.audit.bounds import DEFAULT_TOLERANCE, largest_reportable_bound
from lightning_longshield.audit.canaries import guess_candidates

# --- published values ------------------------------------------------------------------------------------------------
# Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run", arXiv:2305.08846, Appendix D: the worked
# example printed with the p-value and epsilon code. m canaries, r guesses, v = 75 right, 95% confidence. The paper
# prints three decimals, so the computed value must round to the printed one (a tolerance of half a unit, 5e-4).


def test_appendix_d_p_value_for_75_of_100_at_log_3() -> None:
    # Appendix D: m = r = 100, v = 75, eps = log 3 (randomized response with accuracy exactly 3/4), delta = 0 -> 0.553.
    assert round(audit_p_value(100, 100, 75, math.log(3), 0.0), 3) == 0.553


@pytest.mark.parametrize(
    ("m", "delta", "published"),
    [
        (100, 0.0, 0.702),  # Appendix D: m = r = 100, v = 75, delta = 0
        (100, 1e-4, 0.699),  # Appendix D: the same guesses, delta = 1e-4
        (1000, 1e-4, 0.673),  # Appendix D: 900 abstentions (m = 1000, r = 100), delta = 1e-4
    ],
)
def test_appendix_d_epsilon_lower_bounds(m: int, delta: float, published: float) -> None:
    assert round(epsilon_lower_bound(m, 100, 75, delta, 0.95), 3) == published


# --- an independent computation --------------------------------------------------------------------------------------


def _exact_upper_tails(n: int, p: Fraction) -> list[Fraction]:
    """P[Binomial(n, p) >= k] for k = 0..n + 1 as exact fractions: suffix sums of C(n, j) p^j (1 - p)^(n - j)."""
    tails = [Fraction(0)] * (n + 2)
    for j in range(n, -1, -1):
        tails[j] = tails[j + 1] + math.comb(n, j) * p**j * (1 - p) ** (n - j)
    return tails


def _exact_upper_tail(n: int, p: Fraction, k: int) -> Fraction:
    return _exact_upper_tails(n, p)[min(max(k, 0), n + 1)]


def _direct_p_value(m: int, r: int, v: int, epsilon: float, delta: float) -> float:
    """Theorem 5.2's bound from direct sums, with the maximum taken over every i in 1..m as the theorem states."""
    q = Fraction(math.exp(epsilon)) / (1 + Fraction(math.exp(epsilon)))
    tails = _exact_upper_tails(r, q)
    tail = [tails[max(t, 0)] for t in range(v - m, v + 1)]  # tail[m - i] = f(v - i)
    f_v = tail[m]
    slack = max((tail[m - i] - f_v) / i for i in range(1, m + 1)) if m else Fraction(0)
    return min(float(f_v + 2 * m * Fraction(delta) * slack), 1.0)


@pytest.mark.parametrize("n", [0, 1, 7, 40, 120])
@pytest.mark.parametrize("p", [0.0, 0.03, 0.5, 0.731, 0.999, 1.0])
def test_binomial_upper_tail_matches_the_direct_sum(n: int, p: float) -> None:
    tails = _exact_upper_tails(n, Fraction(p))
    for k in range(-1, n + 2):
        exact = float(tails[min(max(k, 0), n + 1)])
        assert binomial_upper_tail(n, p, k) == pytest.approx(exact, rel=1e-11, abs=1e-300)


def test_binomial_upper_tail_is_exact_far_in_the_tail_and_at_audit_sizes() -> None:
    # Far in the tail (near 1e-269, where subtracting from 1 would lose everything) and at 10^5 trials, where the
    # rounding of lgamma near 10^6 limits the relative accuracy to about 1e-10.
    p = Fraction(0.4764897707104784)
    far = sum((math.comb(1000, j) * p**j * (1 - p) ** (1000 - j) for j in range(973, 1001)), Fraction(0))
    assert binomial_upper_tail(1000, 0.4764897707104784, 973) == pytest.approx(float(far), rel=1e-11)
    middle = Fraction(math.comb(100_000, 50_000), 2**100_000)  # P[X = 50000]; by symmetry P[X >= 50000] = (1 + it) / 2
    assert binomial_upper_tail(100_000, 0.5, 50_000) == pytest.approx(float((1 + middle) / 2), rel=1e-9)
    assert binomial_upper_tail(100_000, 0.5, 50_001) == pytest.approx(float((1 - middle) / 2), rel=1e-9)


@pytest.mark.parametrize(("r", "v"), [(1, 1), (10, 7), (25, 25), (40, 30), (60, 41)])
@pytest.mark.parametrize("epsilon", [0.0, 0.4, 1.5, 4.0])
def test_pure_dp_p_value_is_the_binomial_tail_of_randomized_response(r: int, v: int, epsilon: float) -> None:
    q = Fraction(math.exp(epsilon)) / (1 + Fraction(math.exp(epsilon)))
    assert audit_p_value(r + 5, r, v, epsilon, 0.0) == pytest.approx(float(_exact_upper_tail(r, q, v)), rel=1e-11)


@pytest.mark.parametrize(("m", "r", "v"), [(12, 12, 10), (30, 20, 17), (40, 40, 40), (50, 30, 21)])
@pytest.mark.parametrize("delta", [1e-6, 1e-3, 0.02])
@pytest.mark.parametrize("epsilon", [0.3, 1.0, 2.5])
def test_approximate_dp_p_value_matches_the_theorem_by_direct_sums(
    m: int, r: int, v: int, delta: float, epsilon: float
) -> None:
    assert audit_p_value(m, r, v, epsilon, delta) == pytest.approx(_direct_p_value(m, r, v, epsilon, delta), rel=1e-10)


@pytest.mark.parametrize("r", [1, 3, 16, 100, 1000])
@pytest.mark.parametrize("confidence", [0.9, 0.95, 0.99])
def test_pure_dp_all_correct_has_a_closed_form(r: int, confidence: float) -> None:
    # delta = 0 and v = r: the p-value is q^r, so the bound solves q^r = 1 - confidence: eps = log(q / (1 - q)).
    q = (1 - confidence) ** (1 / r)
    expected = max(0.0, math.log(q / (1 - q)))
    bound = epsilon_lower_bound(r, r, r, 0.0, confidence)
    assert expected - DEFAULT_TOLERANCE <= bound <= expected


@pytest.mark.parametrize(("m", "r", "v", "delta"), [(60, 60, 45, 0.0), (40, 30, 27, 1e-3), (25, 25, 22, 1e-4)])
def test_bound_sits_on_the_rejection_boundary_of_the_direct_p_value(m: int, r: int, v: int, delta: float) -> None:
    bound = epsilon_lower_bound(m, r, v, delta, 0.95)
    assert bound > 0
    assert _direct_p_value(m, r, v, bound, delta) < 0.05  # the returned epsilon is rejected ...
    # ... and is the largest such epsilon, to the search tolerance.
    assert _direct_p_value(m, r, v, bound + 2 * DEFAULT_TOLERANCE, delta) >= 0.05


def test_tolerance_sets_the_bracket_width() -> None:
    fine = epsilon_lower_bound(1000, 100, 75, 1e-4, tolerance=1e-10)
    coarse = epsilon_lower_bound(1000, 100, 75, 1e-4, tolerance=1e-2)
    assert fine - 1e-2 <= coarse <= fine


# --- monotonicity ----------------------------------------------------------------------------------------------------


def test_more_correct_guesses_give_a_larger_bound() -> None:
    bounds = [epsilon_lower_bound(1000, 200, v, 1e-5) for v in range(100, 201, 5)]
    assert bounds[0] == 0.0  # half right is what a coin does
    positive = [b for b in bounds if b > 0]
    assert positive and all(a < b for a, b in zip(positive, positive[1:]))
    assert all(a <= b for a, b in zip(bounds, bounds[1:]))


def test_higher_confidence_gives_a_smaller_bound() -> None:
    bounds = [epsilon_lower_bound(1000, 200, 180, 1e-5, c) for c in (0.5, 0.8, 0.9, 0.95, 0.99, 0.999)]
    assert all(a > b for a, b in zip(bounds, bounds[1:]))


def test_larger_delta_gives_a_smaller_bound() -> None:
    bounds = [epsilon_lower_bound(1000, 200, 180, d) for d in (0.0, 1e-8, 1e-6, 1e-5, 1e-4, 1e-3)]
    assert all(a > b for a, b in zip(bounds, bounds[1:]))


def test_more_canaries_behind_the_same_guesses_give_a_smaller_bound_when_delta_is_positive() -> None:
    # The delta term is 2 m delta times the slack: abstaining on more canaries costs confidence.
    bounds = [epsilon_lower_bound(m, 200, 180, 1e-5) for m in (200, 1000, 10_000, 100_000)]
    assert all(a > b for a, b in zip(bounds, bounds[1:]))
    assert epsilon_lower_bound(200, 200, 180, 0.0) == epsilon_lower_bound(100_000, 200, 180, 0.0)


def test_perfect_guesses_bound_grows_with_the_number_of_guesses() -> None:
    rs = [1, 2, 5, 10, 20, 50, 100, 200, 500, 1000]
    for delta in (0.0, 1e-5):
        bounds = [epsilon_lower_bound(1000, r, r, delta) for r in rs]
        assert bounds[0] == 0.0  # one right guess is a coin flip's luck half the time
        positive = [b for b in bounds if b > 0]
        assert len(positive) >= len(rs) - 2
        assert all(a < b for a, b in zip(positive, positive[1:]))
        assert all(a <= b for a, b in zip(bounds, bounds[1:]))


# --- soundness by simulation -----------------------------------------------------------------------------------------
# An exactly eps-DP mechanism: randomized response on each canary's inclusion bit (report it truthfully with
# probability e^eps / (1 + e^eps), flipped otherwise); the auditor guesses the reported bit for the first r canaries and
# abstains on the rest. A 95% lower bound may exceed the true eps in at most 5% of runs. Over TRIALS seeded runs the
# test allows that rate plus 3.5 binomial standard deviations, so even a rate of exactly 5% fails it with probability
# below 3e-4; a broken bound (one ignoring the confidence, say) exceeds it by far.
TRIALS = 2000
LEVEL = 0.05
ALLOWED_VIOLATIONS = math.floor(TRIALS * LEVEL + 3.5 * math.sqrt(TRIALS * LEVEL * (1 - LEVEL)))  # 134 of 2000


@pytest.mark.parametrize(("m", "r", "epsilon", "delta", "seed"), [(200, 200, 1.0, 0.0, 11), (1000, 300, 2.0, 1e-5, 12)])
def test_bound_exceeds_the_true_epsilon_no_more_often_than_the_confidence_allows(
    m: int, r: int, epsilon: float, delta: float, seed: int
) -> None:
    rng = random.Random(seed)
    truthful = math.exp(epsilon) / (1 + math.exp(epsilon))
    cache: dict[int, float] = {}
    violations = 0
    bounds = []
    for _ in range(TRIALS):
        included = [rng.random() < 0.5 for _ in range(m)]
        released = [bit if rng.random() < truthful else not bit for bit in included]
        correct = sum(1 for i in range(r) if released[i] == included[i])
        if correct not in cache:
            cache[correct] = epsilon_lower_bound(m, r, correct, delta, 1 - LEVEL)
        bounds.append(cache[correct])
        violations += cache[correct] > epsilon
    assert violations <= ALLOWED_VIOLATIONS
    assert sorted(bounds)[TRIALS // 2] > 0.25 * epsilon  # and the audit is not vacuous: it usually finds real leakage


def test_a_bound_that_ignores_the_confidence_would_fail_the_simulation_check() -> None:
    # The check above has power: the point estimate log(v / (r - v)) overshoots the true eps about half the time.
    rng = random.Random(13)
    truthful = math.exp(1.0) / (1 + math.exp(1.0))
    overshoots = 0
    for _ in range(TRIALS):
        correct = sum(rng.random() < truthful for _ in range(200))
        overshoots += math.log(correct / (200 - correct)) > 1.0
    assert overshoots > ALLOWED_VIOLATIONS


# --- guesses from scores ---------------------------------------------------------------------------------------------


def test_count_correct_guesses_takes_the_top_and_bottom_scores() -> None:
    scores = [0.9, 0.1, 0.5, 0.8, 0.2, 0.7, 0.3, 0.6]
    included = [True, False, True, False, False, True, True, True]
    # Top 3 (0.9, 0.8, 0.7) guessed in: 2 right; bottom 2 (0.1, 0.2) guessed out: 2 right.
    assert count_correct_guesses(scores, included, 3, 2) == (5, 4)
    assert count_correct_guesses(scores, included, 0, 0) == (0, 0)
    assert count_correct_guesses(scores, included, 8, 0) == (8, 5)
    assert count_correct_guesses(scores, included, 0, 8) == (8, 3)


def test_best_bound_over_candidates_pays_for_the_choice() -> None:
    rng = random.Random(5)
    included = [rng.random() < 0.5 for _ in range(2000)]
    scores = [rng.gauss(1.5 if bit else 0.0, 1.0) for bit in included]
    candidates = [(50, 50), (100, 100), (200, 0), (300, 300)]
    result = best_epsilon_lower_bound(scores, included, 1e-5, candidates)
    assert isinstance(result, AuditResult)
    per_candidate = {
        c: epsilon_lower_bound(2000, *count_correct_guesses(scores, included, *c), 1e-5, 1 - 0.05 / 4)
        for c in candidates
    }
    assert result.epsilon == max(per_candidate.values()) > 0
    assert per_candidate[(result.k_plus, result.k_minus)] == result.epsilon
    assert (result.guesses, result.correct) == count_correct_guesses(scores, included, result.k_plus, result.k_minus)
    # A single fixed candidate is the plain bound at the full confidence.
    single = best_epsilon_lower_bound(scores, included, 1e-5, [(100, 100)])
    assert single.epsilon == epsilon_lower_bound(2000, *count_correct_guesses(scores, included, 100, 100), 1e-5)
    assert single.epsilon >= per_candidate[(100, 100)]


# --- input checks ----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ((10, 5, 6, 1e-5), r"correct=6 is more than guesses=5.*0 <= correct <= guesses <= m"),
        ((10, 11, 3, 1e-5), r"guesses=11 is more than m=10.*0 <= correct <= guesses <= m"),
        ((10, 5, -1, 1e-5), r"correct=-1 is negative"),
        ((10.0, 5, 3, 1e-5), r"m=10.0 must be a whole number"),
        ((10, 5, True, 1e-5), r"correct=True must be a whole number"),
        ((10, 5, 3, 1.0), r"delta=1.0 is outside \[0, 1\)"),
        ((10, 5, 3, -1e-5), r"delta=-1e-05 is outside \[0, 1\)"),
        ((10, 5, 3, math.nan), r"delta=nan is outside \[0, 1\)"),
        ((10, 5, 3, 1e-5, 0.0), r"confidence=0.0 is outside \(0, 1\).*0.95"),
        ((10, 5, 3, 1e-5, 1.0), r"confidence=1.0 is outside \(0, 1\)"),
        ((10, 5, 3, 1e-5, 95), r"confidence=95 is outside \(0, 1\)"),
    ],
)
def test_epsilon_lower_bound_rejects_bad_inputs(args: tuple, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        epsilon_lower_bound(*args)


def test_other_entry_points_reject_bad_inputs() -> None:
    with pytest.raises(ValueError, match="tolerance"):
        epsilon_lower_bound(10, 5, 3, 0.0, tolerance=0.0)
    with pytest.raises(ValueError, match=r"epsilon=-1.0 must be a finite number >= 0"):
        audit_p_value(10, 5, 3, -1.0, 0.0)
    with pytest.raises(ValueError, match=r"p=1.5 must be a probability"):
        binomial_upper_tail(10, 1.5, 3)
    with pytest.raises(ValueError, match=r"k=2.5 must be a whole number"):
        binomial_upper_tail(10, 0.5, 2.5)
    with pytest.raises(ValueError, match="one inclusion bit per canary score"):
        count_correct_guesses([0.1, 0.2], [True], 1, 0)
    with pytest.raises(ValueError, match=r"k_plus \+ k_minus = 3 is more than the 2 canaries"):
        count_correct_guesses([0.1, 0.2], [True, False], 2, 1)
    with pytest.raises(ValueError, match=r"k_minus=-1 must be a whole number >= 0"):
        count_correct_guesses([0.1, 0.2], [True, False], 1, -1)
    with pytest.raises(ValueError, match="NaN"):
        count_correct_guesses([0.1, math.nan], [True, False], 1, 0)
    with pytest.raises(ValueError, match="candidates is empty"):
        best_epsilon_lower_bound([0.1, 0.2], [True, False], 1e-5, [])
    for fractional in ((1.5, 0), (True, 0), (1, -1)):  # never rounded or taken as a count
        with pytest.raises(ValueError, match="must be a whole number|is negative"):
            best_epsilon_lower_bound([0.1, 0.2], [True, False], 1e-5, [fractional])


@pytest.mark.parametrize(("m", "confidence", "largest"), [(60, 0.95, 2.14), (1000, 0.95, 4.91), (1000, 0.999, 1.29)])
def test_an_audits_largest_reportable_bound_is_its_all_correct_bound(m: int, confidence: float,
                                                                      largest: float) -> None:
    """What an audit of ``m`` canaries can report at most (delta 1e-5, the audit's guess counts): a claim at or
    above it cannot be shown broken, which a report must say."""
    candidates = guess_candidates(m)
    ceiling = largest_reportable_bound(m, 1e-5, candidates, confidence)
    assert ceiling == pytest.approx(largest, abs=0.01)
    included = [index % 2 == 0 for index in range(m)]
    oracle = [1.0 if bit else 0.0 for bit in included]  # every guess right
    assert best_epsilon_lower_bound(oracle, included, 1e-5, candidates, confidence).epsilon == ceiling


def test_no_evidence_gives_zero() -> None:
    assert epsilon_lower_bound(0, 0, 0, 0.0) == 0.0
    assert epsilon_lower_bound(100, 0, 0, 1e-5) == 0.0
    assert epsilon_lower_bound(100, 100, 0, 1e-5) == 0.0
    assert epsilon_lower_bound(100, 100, 55, 1e-5) == 0.0
