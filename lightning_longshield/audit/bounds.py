"""Statistics of the one-run privacy audit of Steinke, Nasr and Jagielski, "Privacy Auditing with One (1) Training Run"
(NeurIPS 2023; arXiv:2305.08846).

The auditor plants ``m`` canaries and includes each in the training data independently with probability 1/2. After a
single training run it guesses "included" or "excluded" for ``r`` of them (``guesses``) and abstains on the rest;
``v`` of the guesses are right (``correct``). If training is (eps, delta)-DP, the paper's Theorem 5.2, in the form for
guesses in {-1, 0, +1} that its experiments use (Corollary 5.4; the procedure printed in Appendix D), bounds the
chance of ``v`` or more right guesses:

    P[W >= v] <= f(v) + 2 * m * delta * max_{i = 1..m} (f(v - i) - f(v)) / i,
    f(t) = P[Binomial(r, e^eps / (1 + e^eps)) >= t].

The right side is therefore a p-value for the claim "training is (eps, delta)-DP". The audit's lower bound is the
largest eps that the observed counts reject at the chosen confidence. With delta = 0 the bound is the binomial tail
alone: an eps-DP mechanism cannot guess better than eps-randomized response.

Everything here is plain Python (``math`` only). Binomial probabilities are summed term by term in log space, with no
normal or Poisson approximation; the only error is floating-point rounding, which ``math.lgamma`` makes grow with the
size: a relative error near 1e-12 at 10^3 trials and 1e-10 at 10^5, the largest audits expected.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Sequence
from dataclasses import dataclass

# A sum stops once its terms are decreasing and each is below exp(-_NEGLIGIBLE) times the running total. A binomial
# pmf is unimodal, so everything left is at most n * exp(-50) < 2e-17 (n <= 10^5) of the total: below double precision.
_NEGLIGIBLE = 50.0
# Default width of the final bracket of the epsilon search; the returned epsilon is its lower end, one that is rejected.
DEFAULT_TOLERANCE = 1e-6
# The epsilon bracket doubles up to this; with v <= r the p-value is 1 to double precision long before (eps ~ 40).
_EPSILON_CAP = 4096.0


def _log_add(a: float, b: float) -> float:
    """log(exp(a) + exp(b)) without overflow or underflow."""
    if a < b:
        a, b = b, a
    if b == -math.inf:
        return a
    return a + math.log1p(math.exp(b - a))


def _log_pmf(n: int, k: int, log_p: float, log_1mp: float) -> float:
    """log P[Binomial(n, p) = k] from log p and log(1 - p), via ``math.lgamma``."""
    log_choose = math.lgamma(n + 1) - math.lgamma(k + 1) - math.lgamma(n - k + 1)
    # 0 * log(0) is 0: a success probability of exactly 0 or 1 puts all mass on one end.
    success = k * log_p if k else 0.0
    failure = (n - k) * log_1mp if n - k else 0.0
    return log_choose + success + failure


def _log_sum_outward(n: int, start: int, step: int, log_p: float, log_1mp: float) -> float:
    """log of the sum of P[Binomial(n, p) = j] for j = start, start + step, ... within [0, n] (step is +1 or -1)."""
    total = -math.inf
    previous = -math.inf
    j = start
    while 0 <= j <= n:
        term = _log_pmf(n, j, log_p, log_1mp)
        if term < previous and term < total - _NEGLIGIBLE:
            break
        total = _log_add(total, term)
        previous = term
        j += step
    return total


def _log_upper_tail(n: int, k: int, log_p: float, log_1mp: float) -> float:
    """log P[Binomial(n, p) >= k], summing the side of k away from the bulk of the distribution."""
    if k <= 0:
        return 0.0
    if k > n:
        return -math.inf
    if k > n * math.exp(log_p):
        return _log_sum_outward(n, k, 1, log_p, log_1mp)
    log_lower = _log_sum_outward(n, k - 1, -1, log_p, log_1mp)
    return math.log1p(-min(1.0, math.exp(log_lower)))


def _log_success(epsilon: float) -> tuple[float, float]:
    """log q and log(1 - q) for q = e^eps / (1 + e^eps), the accuracy of eps-randomized response (eps >= 0)."""
    softplus = math.log1p(math.exp(-epsilon))
    return -softplus, -epsilon - softplus


def binomial_upper_tail(n: int, p: float, k: int) -> float:
    """P[Binomial(n, p) >= k], computed in log space with ``math.lgamma`` (no scipy)."""
    n = _as_count("n", n)
    if not isinstance(k, numbers.Integral) or isinstance(k, bool):
        raise ValueError(f"k={k!r} must be a whole number of successes: pass an int")
    if not (isinstance(p, numbers.Real) and 0.0 <= p <= 1.0):
        raise ValueError(f"p={p!r} must be a probability: pass a number in [0, 1]")
    k = int(k)
    if k <= 0:
        return 1.0
    if k > n or p == 0.0:
        return 0.0
    if p == 1.0:
        return 1.0
    return math.exp(_log_upper_tail(n, k, math.log(p), math.log1p(-p)))


def _log_delta_slack(guesses: int, correct: int, log_q: float, log_1mq: float) -> float:
    """log of max_{i = 1..m} (f(v - i) - f(v)) / i, the factor the theorem multiplies by 2 m delta.

    f(v - i) - f(v) = P[v - i <= W < v] grows by P[W = v - i] with each i; the terms are walked down from v - 1. For
    i > v the numerator stays P[W < v] while i grows, so i <= v attains the maximum. The walk stops once the terms fall
    below a negligible fraction of the running sum: from there on the ratio only decreases.
    """
    best = -math.inf
    partial = -math.inf
    previous = -math.inf
    for i in range(1, correct + 1):
        term = _log_pmf(guesses, correct - i, log_q, log_1mq)
        if term < previous and term < partial - _NEGLIGIBLE:
            break
        partial = _log_add(partial, term)
        previous = term
        best = max(best, partial - math.log(i))
    return best


def audit_p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    """Upper bound on P[at least ``correct`` right guesses] for an (epsilon, delta)-DP mechanism (Theorem 5.2)."""
    m, guesses, correct = _check_counts(m, guesses, correct)
    delta = _check_delta(delta)
    if not (isinstance(epsilon, numbers.Real) and math.isfinite(epsilon) and epsilon >= 0):
        raise ValueError(f"epsilon={epsilon!r} must be a finite number >= 0: pass the epsilon being tested")
    return _p_value(m, guesses, correct, float(epsilon), delta)


def _p_value(m: int, guesses: int, correct: int, epsilon: float, delta: float) -> float:
    log_q, log_1mq = _log_success(epsilon)
    p = math.exp(_log_upper_tail(guesses, correct, log_q, log_1mq))
    if delta > 0 and correct > 0:
        p += 2.0 * m * delta * math.exp(_log_delta_slack(guesses, correct, log_q, log_1mq))
    return min(p, 1.0)


def epsilon_lower_bound(
    m: int,
    guesses: int,
    correct: int,
    delta: float,
    confidence: float = 0.95,
    *,
    tolerance: float = DEFAULT_TOLERANCE,
) -> float:
    """Largest epsilon at which ``correct`` right out of ``guesses`` (among ``m`` canaries) rejects (epsilon, delta)-DP.

    A claim is rejected when its p-value (``audit_p_value``) is below ``1 - confidence``. The search doubles an upper
    end until the claim stands there, then bisects until the bracket is narrower than ``tolerance``; it returns the
    bracket's lower end, an epsilon that is rejected, so the result is at most ``tolerance`` below the exact crossing
    and never above it. Returns 0.0 when no positive epsilon is rejected.
    """
    m, guesses, correct = _check_counts(m, guesses, correct)
    delta = _check_delta(delta)
    if not (isinstance(confidence, numbers.Real) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence={confidence!r} is outside (0, 1): pass e.g. 0.95 for a 95% lower bound")
    if not (isinstance(tolerance, numbers.Real) and math.isfinite(tolerance) and tolerance > 0):
        raise ValueError(f"tolerance={tolerance!r} must be a positive number: pass e.g. 1e-6")
    level = 1.0 - float(confidence)

    def rejected(epsilon: float) -> bool:
        return _p_value(m, guesses, correct, epsilon, delta) < level

    if not rejected(0.0):
        return 0.0
    low, high = 0.0, 1.0
    while rejected(high):
        if high >= _EPSILON_CAP:
            return high
        low, high = high, 2.0 * high
    while high - low > tolerance:
        middle = 0.5 * (low + high)
        if rejected(middle):
            low = middle
        else:
            high = middle
    return low


def count_correct_guesses(
    scores: Sequence[float], included: Sequence[bool], k_plus: int, k_minus: int
) -> tuple[int, int]:
    """(guesses, correct) when guessing "included" for the ``k_plus`` highest scores and "excluded" for the ``k_minus``
    lowest (Algorithm 1), abstaining on the rest. Ties are broken by canary index, which does not depend on inclusion.
    """
    size = len(scores)
    if len(included) != size:
        raise ValueError(
            f"scores has {size} entries but included has {len(included)}: pass one inclusion bit per canary score"
        )
    for name, value in (("k_plus", k_plus), ("k_minus", k_minus)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            raise ValueError(f"{name}={value!r} must be a whole number >= 0: pass how many canaries to guess")
    if k_plus + k_minus > size:
        raise ValueError(
            f"k_plus + k_minus = {k_plus + k_minus} is more than the {size} canaries: pass k_plus + k_minus <= m"
        )
    if any(math.isnan(float(score)) for score in scores):
        raise ValueError("scores contain NaN: score every canary with a number (drop or re-score the NaN ones)")
    order = sorted(range(size), key=lambda index: float(scores[index]))
    lowest = order[: int(k_minus)]
    highest = order[size - int(k_plus) :] if k_plus else []
    correct = sum(1 for index in highest if included[index]) + sum(1 for index in lowest if not included[index])
    return int(k_plus) + int(k_minus), correct


@dataclass(frozen=True)
class AuditResult:
    """The best bound over the candidate abstention choices, and the choice that gave it."""

    epsilon: float
    k_plus: int
    k_minus: int
    guesses: int
    correct: int


def best_epsilon_lower_bound(
    scores: Sequence[float],
    included: Sequence[bool],
    delta: float,
    candidates: Sequence[tuple[int, int]],
    confidence: float = 0.95,
) -> AuditResult:
    """Best epsilon lower bound over candidate ``(k_plus, k_minus)`` guess counts, chosen after seeing the scores.

    Choosing among K candidates by their results costs confidence; each candidate is tested at level
    ``(1 - confidence) / K`` (a union bound), so the best of them still holds at ``confidence``. With one candidate
    this is ``epsilon_lower_bound`` of ``count_correct_guesses``.
    """
    unique, per_candidate = _candidates_and_level(candidates, confidence)
    best: AuditResult | None = None
    for k_plus, k_minus in unique:
        guesses, correct = count_correct_guesses(scores, included, k_plus, k_minus)
        epsilon = epsilon_lower_bound(len(scores), guesses, correct, delta, per_candidate)
        if best is None or epsilon > best.epsilon:
            best = AuditResult(epsilon, k_plus, k_minus, guesses, correct)
    assert best is not None
    return best


def largest_reportable_bound(
    m: int, delta: float, candidates: Sequence[tuple[int, int]], confidence: float = 0.95
) -> float:
    """The most `best_epsilon_lower_bound` can report for ``m`` canaries: every guess right at every candidate. An
    audit whose claim is at or above it cannot show the claim broken, whatever the mechanism does."""
    unique, per_candidate = _candidates_and_level(candidates, confidence)
    return max(epsilon_lower_bound(m, k_plus + k_minus, k_plus + k_minus, delta, per_candidate)
               for k_plus, k_minus in unique)


def _candidates_and_level(candidates: Sequence[tuple[int, int]], confidence: float) -> tuple[list[tuple[int, int]],
                                                                                            float]:
    """The distinct ``(k_plus, k_minus)`` candidates (whole numbers, checked) and the confidence each is tested at,
    ``1 - (1 - confidence) / K`` (a union bound over the K of them)."""
    unique = list(dict.fromkeys((_as_count("k_plus", k_plus), _as_count("k_minus", k_minus))
                                for k_plus, k_minus in candidates))
    if not unique:
        raise ValueError("candidates is empty: pass at least one (k_plus, k_minus) pair, e.g. [(100, 100)]")
    if not (isinstance(confidence, numbers.Real) and 0.0 < confidence < 1.0):
        raise ValueError(f"confidence={confidence!r} is outside (0, 1): pass e.g. 0.95 for a 95% lower bound")
    return unique, 1.0 - (1.0 - float(confidence)) / len(unique)


def _as_count(name: str, value: object) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be a whole number: pass an int")
    if value < 0:
        raise ValueError(f"{name}={value} is negative: pass a count >= 0")
    return int(value)


def _check_counts(m: object, guesses: object, correct: object) -> tuple[int, int, int]:
    m, guesses, correct = _as_count("m", m), _as_count("guesses", guesses), _as_count("correct", correct)
    if guesses > m:
        raise ValueError(
            f"guesses={guesses} is more than m={m}: each guess is about one of the m canaries, "
            "so pass 0 <= correct <= guesses <= m"
        )
    if correct > guesses:
        raise ValueError(
            f"correct={correct} is more than guesses={guesses}: correct counts the right guesses among those made, "
            "so pass 0 <= correct <= guesses <= m"
        )
    return m, guesses, correct


def _check_delta(delta: object) -> float:
    if not (isinstance(delta, numbers.Real) and 0.0 <= delta < 1.0):
        raise ValueError(
            f"delta={delta!r} is outside [0, 1): pass the delta of the claim audited, e.g. 1e-5 (0 for pure DP)"
        )
    return float(delta)
