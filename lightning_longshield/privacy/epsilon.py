"""Epsilon of a history of Poisson-subsampled Gaussian steps, in bounded time and memory.

A history is a list of ``(noise_multiplier, sample_rate, steps)`` runs, as Opacus's accountants keep it.

- ``"rdp"``: Opacus's RDP analysis (`compute_rdp`, `get_privacy_spent` over its default orders); the per-step RDP
  curve of each ``(sigma, q)`` is computed once per process and cached, so composing any number of steps is free.
- ``"prv"``: the numerical composition of privacy random variables (Gopi et al., 2021) with Opacus's PRV
  primitives, returning the certified upper bound ``eps_upper``. Opacus's own `PRVAccountant` sizes its grid from
  the target accuracy ``eps_error = 0.01`` alone, which for small sigma, large q or many steps means billions of
  points (minutes, gigabytes). Here the grid is capped at `MAX_PRV_DOMAIN_POINTS`: where the default accuracy
  needs more, ``eps_error`` is raised until the grid fits. The result stays a certified upper bound, only a looser
  one (such regimes have epsilon in the tens or more, where an error of a few tenths is immaterial). The answer is
  the smaller of that bound and the RDP bound (both are upper bounds on the same epsilon), which also covers
  regimes where the PRV grid cannot resolve the answer at all. Inside the cap it equals Opacus's `PRVAccountant`.
"""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable, Sequence
from functools import lru_cache

import numpy as np
from opacus.accountants import RDPAccountant
from opacus.accountants.analysis import rdp as rdp_analysis
from opacus.accountants.analysis.prv import (
    Domain,
    PoissonSubsampledGaussianPRV,
    TruncatedPrivacyRandomVariable,
    compose_heterogeneous,
    discretize,
)
from scipy.special import log_ndtr, ndtr

History = Sequence[tuple[float, float, int]]

PRV_EPS_ERROR = 0.01  # Opacus's default accuracy of the PRV epsilon
MAX_PRV_DOMAIN_POINTS = 2**20  # about 0.5 s and 100 MB per evaluation on 2 CPU cores
MAX_PRV_HALF_WIDTH = 700.0  # exp(700) is near float64's limit
RDP_ORDERS = tuple(RDPAccountant.DEFAULT_ALPHAS)


@lru_cache(maxsize=256)
def _rdp_curve(noise_multiplier: float, sample_rate: float) -> np.ndarray:
    """RDP of one step at every order of `RDP_ORDERS` (the expensive part of RDP accounting)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        curve = rdp_analysis.compute_rdp(
            q=sample_rate, noise_multiplier=noise_multiplier, steps=1, orders=list(RDP_ORDERS)
        )
    return np.asarray(curve, dtype=np.float64)


def rdp_epsilon(history: History, delta: float) -> float:
    """Epsilon at ``delta`` by the RDP accountant (equal to Opacus's `RDPAccountant.get_epsilon`)."""
    if not history:
        return 0.0
    rdp = sum(_rdp_curve(sigma, q) * steps for sigma, q, steps in history)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "optimal order is the largest alpha": a looser bound, still a bound
        epsilon, _ = rdp_analysis.get_privacy_spent(orders=list(RDP_ORDERS), rdp=rdp, delta=delta)
    return float(epsilon)


def _prv_half_width(history: History, eps_error: float, delta_error: float) -> float:
    """Half-width L of the PRV grid such that truncating to [-L, L] costs at most ``delta_error`` (Gopi et al.,
    remark 5.6, bounding the tails with RDP), as Opacus's `compute_safe_domain_size` chooses it."""
    total_steps = sum(steps for _, _, steps in history)
    tail = rdp_epsilon(history, delta_error / 4)
    single_step = max(rdp_epsilon([(sigma, q, 1)], delta_error / (8 * total_steps)) for sigma, q, _ in history)
    return max(tail, single_step, eps_error) + 3


def prv_epsilon(history: History, delta: float, max_points: int = MAX_PRV_DOMAIN_POINTS) -> float:
    """Certified upper bound on epsilon at ``delta`` from the PRV accountant, on a grid of at most ``max_points``."""
    if not history:
        return 0.0
    delta_error = delta / 1000
    total_steps = sum(steps for _, _, steps in history)
    spread = math.sqrt(total_steps * math.log(12 / delta_error) / 2)  # grid step = eps_error / spread
    eps_error = PRV_EPS_ERROR
    half_width = _prv_half_width(history, eps_error, delta_error)
    if 2 * half_width * spread / eps_error > max_points:
        eps_error = 2 * half_width * spread / max_points
        half_width = _prv_half_width(history, eps_error, delta_error)
        eps_error = 2 * half_width * spread / max_points
    if half_width > MAX_PRV_HALF_WIDTH:
        return math.inf  # exp(t) overflows float64 on such a grid; epsilon is in the hundreds anyway
    domain = Domain.create_aligned(-half_width, half_width, eps_error / spread)
    # Any overflow or invalid value would leave the bound meaningless: raise, and `epsilon` falls back to RDP.
    with np.errstate(over="raise", invalid="raise", divide="raise", under="ignore"):
        discrete = [
            discretize(
                TruncatedPrivacyRandomVariable(PoissonSubsampledGaussianPRV(q, sigma), domain.t_min, domain.t_max),
                domain,
            )
            for sigma, q, _ in history
        ]
        composed = compose_heterogeneous(discrete, [steps for _, _, steps in history])
        _, _, eps_upper = composed.compute_epsilon(delta, delta_error, eps_error)
    return float(eps_upper)


def gaussian_epsilon(history: History, delta: float) -> float:
    """Epsilon at ``delta`` of a history of unsampled Gaussian steps (``q = 1``, as full batches are): exact, as their
    composition is the Gaussian mechanism of ``mu = sqrt(sum steps / sigma^2)`` (Dong, Roth and Su's GDP), whose
    ``delta(eps) = Phi(mu / 2 - eps / mu) - e^eps Phi(-mu / 2 - eps / mu)`` (Balle and Wang) is solved by bisection
    from above, against a delta a billionth smaller (the rounding of its evaluation)."""
    mu = math.sqrt(sum(steps / sigma**2 for sigma, _, steps in history))
    target = delta * (1 - 1e-9)

    def delta_at(eps: float) -> float:
        return float(ndtr(mu / 2 - eps / mu) - np.exp(eps + log_ndtr(-mu / 2 - eps / mu)))

    if delta_at(0.0) <= target:
        return 0.0
    low, high = 0.0, 1.0
    while delta_at(high) > target:
        low, high = high, 2 * high
    while high - low > 1e-12 * max(1.0, high):
        middle = (low + high) / 2
        low, high = (middle, high) if delta_at(middle) > target else (low, middle)
    return high


def epsilon(history: History, delta: float, mechanism: str) -> float:
    """Epsilon at ``delta`` of ``history`` (0 if empty, infinite if a step had no noise)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    if not history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf
    rdp = rdp_epsilon(history, delta)
    if mechanism == "rdp":
        return rdp
    if all(q == 1 for _, q, _ in history):  # PRV's sampled-Gaussian variable takes log(1 - q)
        return min(gaussian_epsilon(history, delta), rdp)
    try:
        prv = prv_epsilon(history, delta)
    except (ValueError, RuntimeError, FloatingPointError):
        return rdp  # the grid could not resolve this regime; RDP's bound still holds
    return prv if math.isfinite(prv) and prv < rdp else rdp


def calibrate_noise_multiplier(
    target_epsilon: float, delta: float, sample_rate: float, steps: int, mechanism: str, tolerance: float = 0.01
) -> float:
    """A noise multiplier whose ``steps`` steps spend at most ``target_epsilon`` and at least ``target - tolerance``.

    With ``"prv"`` the search starts from the RDP calibration (cheap, and always feasible: the PRV answer is at most
    the RDP one). Sigma is bracketed by stepping geometrically, then the bracket is closed by false position on
    ``log eps`` against ``log sigma`` (Illinois variant): a handful of accountant evaluations where bisection needs
    twenty. The returned sigma always comes from an evaluation that met the target.
    """
    if not 0 < target_epsilon < math.inf:
        raise ValueError(
            f"target_epsilon must be > 0 and finite, got {target_epsilon}: a finite budget is what the noise is"
            " calibrated to (noise_multiplier=0.0 is the non-private run)."
        )

    def log_excess(sigma: float) -> float:
        value = epsilon([(sigma, sample_rate, steps)], delta, mechanism)
        return math.log(value / target_epsilon) if math.isfinite(value) and value > 0 else math.inf

    start, factor = 1.0, 2.0
    if mechanism != "rdp":
        try:
            start = calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, "rdp", tolerance)
            factor = 1.25
        except ValueError:
            pass  # RDP's orders cannot certify so small an epsilon; PRV may: search from sigma = 1
    low = high = start
    f_low = f_high = log_excess(start)
    while f_high > 0:  # too little noise: step up
        low, f_low = high, f_high
        high *= factor
        if high > 1e6:
            raise ValueError(
                f"target_epsilon={target_epsilon:g} at delta={delta:.3g} needs a noise multiplier above 1e6 for"
                f" {steps} steps at sampling rate {sample_rate:.3g}: raise the budget or sample less."
            )
        f_high = log_excess(high)
    while f_low <= 0:  # the target is met: step down until it is not
        if target_epsilon * (1 - math.exp(f_low)) <= tolerance or low < 1e-3:
            return low
        high, f_high = low, f_low
        low /= factor
        f_low = log_excess(low)
    return close_noise_bracket(log_excess, low, f_low, high, f_high, target_epsilon, tolerance)


def close_noise_bracket(
    log_excess: Callable[[float], float],
    low: float,
    f_low: float,
    high: float,
    f_high: float,
    target_epsilon: float,
    tolerance: float,
) -> float:
    """The noise multiplier in ``[low, high]`` (``log_excess(low) > 0 >= log_excess(high)``, given as ``f_low`` and
    ``f_high``) whose epsilon is at most ``target_epsilon`` and within ``tolerance`` of it, by false position on
    ``log eps`` against ``log sigma`` (Illinois variant). The returned sigma always comes from an evaluation that met
    the target."""
    if target_epsilon * (1 - math.exp(f_high)) <= tolerance:
        return high
    weight_low, weight_high, side = f_low, f_high, 0
    for _ in range(60):
        if high / low - 1 < 1e-6:
            break
        log_low, log_high = math.log(low), math.log(high)
        if math.isfinite(weight_low):
            guess = log_high - weight_high * (log_high - log_low) / (weight_high - weight_low)
            margin = 0.01 * (log_high - log_low)
            guess = min(max(guess, log_low + margin), log_high - margin)
        else:
            guess = (log_low + log_high) / 2
        sigma = math.exp(guess)
        f_sigma = log_excess(sigma)
        if f_sigma <= 0:
            high, weight_high = sigma, f_sigma
            if target_epsilon * (1 - math.exp(f_sigma)) <= tolerance:
                break
            if side == 1:
                weight_low /= 2  # Illinois: keep the stale end from freezing the interpolation
            side = 1
        else:
            low, weight_low = sigma, f_sigma
            if side == -1:
                weight_high /= 2
            side = -1
    return high
