"""Epsilon of DP-SGD with randomized clipping, noise calibration, and an accountant for the strategy.

A history is a list of ``(noise_multiplier, sample_rate, steps)`` runs, as the project's other accountants keep it.
Each run's per-step distribution (`mechanism.step_pld`) is composed by FFT (`pld`), the runs are composed
together, and epsilon is read off for both neighbouring directions; the larger is returned. Every stage only
over-states delta, so the result is an upper bound on the epsilon of the mechanism described in `envelope`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any, Optional

from lightning_longshield.privacy.accountant import PrivacyAccountant
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier as calibrate_exact_clipping
from lightning_longshield.privacy.epsilon import close_noise_bracket
from lightning_longshield.privacy.randomized.envelope import ScaleEnvelope, scale_envelope
from lightning_longshield.privacy.randomized.mechanism import DEFAULT_DISCRETIZATION, Discretization, step_pld
from lightning_longshield.privacy.randomized.pld import PrivacyLossDistribution

History = Sequence[tuple[float, float, int]]

WINDOW_SPREAD = 12.0  # standard deviations of the composed loss kept on each side of its mean
WINDOW_MARGIN = 20.0  # plus this much loss; the window doubles while epsilon lands within half of it of the top
MAX_LOSS = 500.0  # the window never reaches beyond +-this many nats (exp overflows at 709)


def _composed(
    history: History,
    delta: float,
    envelope: ScaleEnvelope,
    remove: bool,
    discretization: Discretization,
    widen: float,
) -> tuple[PrivacyLossDistribution, float, bool]:
    """The composed distribution of ``history`` in one direction, the largest loss its window keeps and whether
    that window hit `MAX_LOSS`."""
    tail = discretization.scale_tail(delta, sum(q * steps for _, q, steps in history))
    per_step = [(step_pld(sigma, q, envelope, remove, discretization, tail), steps) for sigma, q, steps in history]
    mean = variance = 0.0
    for pld, steps in per_step:
        step_mean, step_std = pld.mean_and_std()
        mean += steps * step_mean
        variance += steps * step_std**2
    spread = WINDOW_SPREAD * math.sqrt(variance) + WINDOW_MARGIN * widen
    # Partial compositions have means between 0 and the total's, and smaller spreads, so one window fits all.
    top = min(max(mean, 0.0) + spread, MAX_LOSS)
    step = discretization.loss_step
    lower, upper = math.floor(-min(spread, MAX_LOSS) / step), math.ceil(top / step)
    composed: Optional[PrivacyLossDistribution] = None
    for pld, steps in per_step:
        run = pld.self_compose(steps, lower, upper)
        composed = run if composed is None else composed.compose(run, lower, upper)
    assert composed is not None
    return composed, upper * step, top == MAX_LOSS


def _direction_epsilon(
    history: History, delta: float, envelope: ScaleEnvelope, remove: bool, discretization: Discretization
) -> float:
    widen = 1.0
    while True:
        composed, top, capped = _composed(history, delta, envelope, remove, discretization, widen)
        value = composed.epsilon(delta)
        if value < top - WINDOW_MARGIN / 2 or capped:
            return value
        widen *= 2  # epsilon near the window's top: the truncation may dominate, so widen and redo


def history_epsilon(
    history: History, delta: float, envelope: ScaleEnvelope, discretization: Discretization = DEFAULT_DISCRETIZATION
) -> float:
    """Epsilon at ``delta`` of a history under randomized clipping (0 if empty, ``inf`` if a step had no noise)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}.")
    history = [(float(sigma), float(q), int(steps)) for sigma, q, steps in history if steps > 0]
    if not history:
        return 0.0
    if any(sigma == 0 for sigma, _, _ in history):
        return math.inf
    return max(_direction_epsilon(history, delta, envelope, remove, discretization) for remove in (True, False))


def get_epsilon(
    noise_multiplier: float,
    sample_rate: float,
    steps: int,
    delta: float,
    projections: Optional[int],
    estimator: str = "hutchinson",
    discretization: Discretization = DEFAULT_DISCRETIZATION,
) -> float:
    """Epsilon at ``delta`` of ``steps`` Poisson-subsampled steps whose norms come from ``estimator`` with
    ``projections`` Gaussian projections (``estimator="exact"`` for exact clipping)."""
    envelope = scale_envelope(estimator, projections)
    return history_epsilon([(noise_multiplier, sample_rate, steps)], delta, envelope, discretization)


def calibrate_noise_multiplier(
    target_epsilon: float,
    delta: float,
    sample_rate: float,
    steps: int,
    projections: Optional[int],
    estimator: str = "hutchinson",
    tolerance: float = 0.01,
    discretization: Discretization = DEFAULT_DISCRETIZATION,
) -> float:
    """The noise multiplier whose ``steps`` steps spend at most ``target_epsilon`` (and within ``tolerance`` of it).

    Never below the exact-clipping calibration of the project's PRV accountant: randomized clipping's worst-case
    scale ``Z`` is at least 1, so it needs at least as much noise. From there sigma is stepped up until the target
    is met and the bracket is closed by false position on ``log epsilon`` against ``log sigma`` (Illinois). The
    returned sigma always comes from an evaluation that met the target.
    """
    if not target_epsilon > 0:
        raise ValueError(f"target_epsilon must be > 0, got {target_epsilon}.")
    envelope = scale_envelope(estimator, projections)

    def log_excess(sigma: float) -> float:
        value = history_epsilon([(sigma, sample_rate, steps)], delta, envelope, discretization)
        return math.log(max(value, 1e-12) / target_epsilon) if math.isfinite(value) else math.inf

    low = calibrate_exact_clipping(target_epsilon, delta, sample_rate, steps, "prv", tolerance)
    f_low = log_excess(low)
    if f_low <= 0:
        return low
    high, f_high = low, f_low
    while f_high > 0:
        low, f_low = high, f_high
        high *= 1.1
        if high > 1e6:
            raise ValueError(f"target_epsilon={target_epsilon:g} needs a noise multiplier above 1e6.")
        f_high = log_excess(high)
    return close_noise_bracket(log_excess, low, f_low, high, f_high, target_epsilon, tolerance)


class RandomizedClippingAccountant(PrivacyAccountant):
    """`PrivacyAccountant` for DP steps of randomized clipping: the same history, cache and budget search, with
    epsilon from `history_epsilon` under the estimator's envelope; its state records the estimator and projections.
    """

    def __init__(
        self, estimator: str, projections: int, discretization: Discretization = DEFAULT_DISCRETIZATION
    ) -> None:
        super().__init__("prv")  # Opacus's PRV accountant only keeps the history
        self.mechanism = "randomized-prv"
        self.envelope = scale_envelope(estimator, projections)
        self.discretization = discretization

    def _compute_epsilon(self, history: list[tuple[float, float, int]], delta: float) -> float:
        return history_epsilon(history, delta, self.envelope, self.discretization)

    def calibrate_noise_multiplier(self, target_epsilon: float, delta: float, sample_rate: float, steps: int) -> float:
        return calibrate_noise_multiplier(target_epsilon, delta, sample_rate, steps, self.envelope.projections,
                                          self.envelope.estimator, discretization=self.discretization)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "estimator": self.envelope.estimator,
                "projections": self.envelope.projections}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        stored = (state.get("mechanism"), state.get("estimator"), state.get("projections"))
        ours = (self.mechanism, self.envelope.estimator, self.envelope.projections)
        if stored != ours:
            raise ValueError(
                f"The checkpoint was accounted as (mechanism, estimator, projections)={stored} but this run uses"
                f" {ours}; resume with the checkpoint's norm estimator and projections."
            )
        super().load_state_dict(state)
