"""Epsilon of DP-SGD with randomized clipping, noise calibration, and an accountant for the strategy.

A history is a list of ``(noise_multiplier, sample_rate, steps)`` runs, as the project's other accountants keep it.
Each run's per-step distribution (`mechanism.step_pld`) is composed by FFT (`pld`), the runs are composed
together, and epsilon is read off for both neighbouring directions; the larger is returned. Every stage only
over-states delta, so the result is an upper bound on the epsilon of the mechanism described in `envelope`.

The loss grid is refined per direction (`mechanism.loss_steps`: from 2e-3 towards a quarter of one step's loss
standard deviation) while a finer grid lowers epsilon by at least `GRID_GAIN`; each grid's epsilon is an upper
bound, and the smallest is kept. Only the direction whose epsilon is currently the larger is refined.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from typing import Any, Optional

from lightning_longshield.privacy.accountant import PrivacyAccountant, resume_hint
from lightning_longshield.privacy.epsilon import calibrate_noise_multiplier as calibrate_exact_clipping
from lightning_longshield.privacy.epsilon import close_noise_bracket
from lightning_longshield.privacy.randomized.envelope import ScaleEnvelope, scale_envelope
from lightning_longshield.privacy.randomized.mechanism import (
    DEFAULT_DISCRETIZATION,
    Discretization,
    loss_steps,
    step_pld,
)
from lightning_longshield.privacy.randomized.pld import PrivacyLossDistribution
from lightning_longshield.privacy.rank_zero import rank_zero_warn

History = Sequence[tuple[float, float, int]]

#: A calibrated noise multiplier this many times exact clipping's is warned about (1.07-1.13 is the usual cost).
EXCESS_NOISE_WARNING = 1.5
WINDOW_SPREAD = 12.0  # standard deviations of the composed loss kept on each side of its mean
WINDOW_MARGIN = 20.0  # plus this much loss; the window doubles while epsilon lands within half of it of the top
WINDOW_MARGIN_STEPS = 10_000  # but at most this many grid steps (fine grids come with narrow losses)
WINDOW_INFINITY_SHARE = 0.01  # the window also doubles while more than this * delta sits at +inf
MAX_WINDOW_POINTS = 2**20  # but stops doubling at this many grid points
MAX_LOSS = 500.0  # the window never reaches beyond +-this many nats (exp overflows at 709)
GRID_ERROR_SHARE = 0.25  # finer loss grids are tried while their floating-point bound is predicted below this * delta
GRID_GAIN = 0.01  # and while each one lowers epsilon by at least this share


def _composed(
    history: History,
    delta: float,
    envelope: ScaleEnvelope,
    remove: bool,
    discretization: Discretization,
    step: float,
    margin: float,
) -> tuple[PrivacyLossDistribution, float, bool]:
    """The composed distribution of ``history`` in one direction on a loss grid of step ``step`` (its window
    ``margin`` nats wider than `WINDOW_SPREAD` standard deviations on each side), the largest loss its window keeps
    and whether that window may not grow (it reaches `MAX_LOSS`, or doubling it would pass `MAX_WINDOW_POINTS`)."""
    tail = discretization.scale_tail(delta, sum(q * steps for _, q, steps in history))
    per_step = [(step_pld(sigma, q, envelope, remove, discretization, tail, step), steps)
                for sigma, q, steps in history]
    mean = variance = 0.0
    for pld, steps in per_step:
        step_mean, step_std = pld.mean_and_std()
        mean += steps * step_mean
        variance += steps * step_std**2
    spread = WINDOW_SPREAD * math.sqrt(variance) + margin
    # Partial compositions have means between 0 and the total's, and smaller spreads, so one window fits all.
    top = min(max(mean, 0.0) + spread, MAX_LOSS)
    lower, upper = math.floor(-min(spread, MAX_LOSS) / step), math.ceil(top / step)
    capped = top == MAX_LOSS or 2 * (upper - lower) > MAX_WINDOW_POINTS  # the window may not double again
    composed: Optional[PrivacyLossDistribution] = None
    for pld, steps in per_step:
        run = pld.self_compose(steps, lower, upper)
        composed = run if composed is None else composed.compose(run, lower, upper)
    assert composed is not None
    return composed, upper * step, capped


def _direction_epsilons(
    history: History, delta: float, envelope: ScaleEnvelope, remove: bool, discretization: Discretization
) -> Iterator[float]:
    """Epsilon of one direction on ever finer loss grids (`loss_steps`), each value an upper bound and smaller than
    the one before; it ends once a finer grid lowers epsilon by less than `GRID_GAIN`."""
    tail = discretization.scale_tail(delta, sum(q * steps for _, q, steps in history))
    best = math.inf
    for step in loss_steps(history, envelope, remove, discretization, tail, GRID_ERROR_SHARE * delta):
        value = _grid_epsilon(history, delta, envelope, remove, discretization, step)
        if value < best:
            yield value
        if not value < best * (1 - GRID_GAIN):
            return
        best = value


def _grid_epsilon(
    history: History,
    delta: float,
    envelope: ScaleEnvelope,
    remove: bool,
    discretization: Discretization,
    step: float,
) -> float:
    margin = min(WINDOW_MARGIN, WINDOW_MARGIN_STEPS * step)
    widen = 1.0
    while True:
        composed, top, capped = _composed(history, delta, envelope, remove, discretization, step, margin * widen)
        value = composed.epsilon(delta)
        if composed.error >= delta:  # a wider window only adds floating-point error: epsilon stays infinite
            return value
        if (value < top - margin / 2 and composed.infinity_mass <= WINDOW_INFINITY_SHARE * delta) or capped:
            return value
        widen *= 2  # epsilon near the window's top or mass cut to +inf: the truncation may dominate, so redo wider


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
    # Epsilon is the larger direction's: only the direction now larger is refined, until its grids stop paying.
    searches = [_direction_epsilons(history, delta, envelope, remove, discretization) for remove in (True, False)]
    bests = [next(search, math.inf) for search in searches]
    while True:
        larger = 0 if bests[0] >= bests[1] else 1
        value = next(searches[larger], None)
        if value is None:
            return bests[larger]
        bests[larger] = value


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

    exact = low = calibrate_exact_clipping(target_epsilon, delta, sample_rate, steps, "prv", tolerance)
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
    sigma = close_noise_bracket(log_excess, low, f_low, high, f_high, target_epsilon, tolerance)
    if sigma > EXCESS_NOISE_WARNING * exact:
        rank_zero_warn(
            f"Randomized clipping's accountant calibrated noise_multiplier={sigma:.4g} for target_epsilon="
            f"{target_epsilon:g} over {steps} steps: {sigma / exact:.2f}x the {exact:.4g} exact clipping needs. Its"
            " bound adds a floating-point allowance at every step, which over many steps can approach target_delta"
            f" ({delta:g}) and then costs far more noise than the projections do. Fewer planned steps, a larger"
            " target_delta or exact norms (norms='materialize', 'mixed' or 'ghost') need less noise."
        )
    return sigma


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
                f" {ours}; {resume_hint(state)}"
            )
        super().load_state_dict(state)
