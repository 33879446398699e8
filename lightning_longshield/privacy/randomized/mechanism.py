"""Privacy loss of one Poisson-subsampled Gaussian step whose sensitivity is scaled by a random ``Z``.

One step with sampling rate ``q`` and noise multiplier ``sigma`` is, given ``Z = z`` (released to the adversary,
see `envelope`), the subsampled Gaussian pair with mean ``mu = z / sigma`` (unit noise):

- remove: ``A = (1 - q) N(0, 1) + q N(mu, 1)`` against ``B = N(0, 1)``, loss
  ``l(x) = log(1 - q + q exp(mu x - mu^2 / 2))``, increasing in ``x``;
- add: ``A = N(0, 1)`` against ``B = (1 - q) N(0, 1) + q N(mu, 1)``, loss ``-l(x)``.

Both directions are accounted and the larger epsilon is reported (add/remove adjacency under Poisson
subsampling; Zhu, Dong & Wang, "Optimal Accounting of Differential Privacy via Characteristic Function",
AISTATS 2022). The pair with ``Z`` observed has the mixture over ``z`` of these losses as its privacy loss
distribution.

Discretisation, each step of which can only increase every ``delta(epsilon)``:

1. ``Z`` is rounded up to a grid (`discretize_scale`) and its tail beyond the grid is taken as ``Z = inf``. A
   larger ``z`` dominates a smaller one: from ``(z', X)`` with ``X ~ N(z'/sigma, 1)`` or ``N(0, 1)``, drawing
   ``z <= z'`` and ``(z/z') X + sqrt(1 - (z/z')^2) N(0, 1)`` reproduces the pair at ``z`` under both hypotheses
   (and the Poisson mixtures with it), so a stochastically larger ``Z`` dominates (Strassen coupling).
   ``Z = inf`` replaces ``N(mu, 1)`` by an outcome ``B`` never produces (loss ``+inf`` for remove;
   ``-log(1 - q)`` for add).
2. The losses of each ``z`` are cut to a band holding all but ``component_cut`` of its mass (and within
   ``+-MAX_STEP_LOSS``): mass below is rounded up to the band's lowest loss, mass above goes to ``+inf``
   (dominating pairs, see `pld`).
3. The mass of each grid interval ``(t_{i-1}, t_i]`` is split between its two ends so that both its ``A``-mass and
   its ``B``-mass (``E_A[exp(-L)]``) are kept: the "connect the dots" discretisation of Doroshenko, Ghazi, Kamath,
   Kumar & Manurangsi (PETS 2022). Merging the two ends back is a post-processing, so the discrete pair dominates;
   its error is second order in the grid step, unlike rounding every loss up.

The loss grid's step matters over many compositions: connect the dots spreads each interval's mass over its two
ends, which adds about ``step^2 / 6`` to the variance of every step's loss, so the composed loss comes out wider by
a factor of about ``1 + (step / std)^2 / 12``, ``std`` being one step's standard deviation (about
``q sqrt(exp(1 / sigma^2) - 1)``: 5e-4 at ``q = 1e-3``, ``sigma = 2``, where a step of 2e-3 overstated epsilon by
65 % after 10^4 steps). Unless `Discretization.loss_step` fixes it, the accountant therefore tries steps from
`MAX_LOSS_STEP` down to ``loss_step_ratio`` times that standard deviation (`loss_steps`; the default 1/4 widens
the composed loss by about 0.5 %) and keeps the smallest epsilon. Every step gives an upper bound, so their
minimum is one; finer grids only cost time and a larger floating-point allowance (below), which is why the finest
is not always the tightest.

Floating point: interval masses come from differences of normal CDFs (``scipy.special.ndtr``, accurate to a few
units in the last place), taken on the CDF side for losses ``<= 0`` and on the survival side above, so values are
small where they are many. A relative error ``r`` in a CDF value moves mass by ``r`` times that value across one
grid step, and the split moves its error over one grid step too; both change ``delta`` by at most
``r * (A-value + exp(t) B-value)`` per grid point, which `error` adds up with ``r = SPECIAL_FUNCTION_ERROR``.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from functools import lru_cache
from typing import Optional

import numpy as np
from scipy.special import ndtr, ndtri

from lightning_longshield.privacy.randomized.envelope import ScaleEnvelope
from lightning_longshield.privacy.randomized.pld import PrivacyLossDistribution

SPECIAL_FUNCTION_ERROR = 1e-13  # relative error allowed for ndtr and the chi-square CDF (far above their actual)
COARSE_TAIL = 1e-6  # P(Z > z) below which the scale grid coarsens
MAX_SCALE_STEP = 0.25
MAX_STEP_LOSS = 150.0  # one step's losses above this count as +inf, below minus this are rounded up to it
MAX_LOSS_STEP = 2e-3  # the coarsest loss grid tried (the fixed step of earlier releases)
MIN_LOSS_STEP = 2e-5  # the finest (one step's distribution then has 1e5 points for every 2 nats of loss)


@dataclass(frozen=True)
class Discretization:
    """Grids of the accountant. Every choice keeps epsilon an upper bound; finer grids make it tighter.

    ``loss_step``: spacing of the privacy-loss grid; ``None`` (default) lets the accountant try grids per history
    and direction (`loss_steps`), down to ``loss_step_ratio`` times the smallest standard deviation of one step's
    loss, within ``[MIN_LOSS_STEP, MAX_LOSS_STEP]``, and report the smallest epsilon. ``scale_ratio``:
    ``Z`` is rounded up to powers of ``1 + scale_ratio`` (so ``mu`` is overstated by at most that factor).
    ``scale_tail_share``: the tail of ``Z`` taken as ``Z = inf`` adds at most this share of delta (its mass is
    ``share * delta / sum(q * steps)``, rounded down to a power of 10). ``component_cut``: mass of each ``z`` left
    out of its loss band (moved pessimistically).
    """

    loss_step: Optional[float] = None
    scale_ratio: float = 2e-3
    scale_tail_share: float = 1e-3
    component_cut: float = 1e-20
    loss_step_ratio: float = 0.25

    def __post_init__(self) -> None:
        for name in ("scale_ratio", "scale_tail_share", "component_cut", "loss_step_ratio"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}.")
        if self.loss_step is not None and not 0 < self.loss_step < 1:
            raise ValueError(f"loss_step must be None or in (0, 1), got {self.loss_step}.")

    def scale_tail(self, delta: float, expected_releases: float) -> float:
        """``P(Z > z_max)`` for a history with ``sum(q * steps) = expected_releases``."""
        return 10.0 ** math.floor(math.log10(self.scale_tail_share * delta / max(expected_releases, 1.0)))


DEFAULT_DISCRETIZATION = Discretization()


@dataclass(frozen=True)
class DiscreteScale:
    """``Z`` rounded up: ``weights[j] = P(values[j-1] < Z <= values[j])`` and ``tail = P(Z > values[-1])``.

    ``error`` bounds the total absolute error of the weights and the tail (each is a difference of CDF values).
    """

    values: np.ndarray
    weights: np.ndarray
    tail: float
    error: float


@lru_cache(maxsize=32)
def discretize_scale(envelope: ScaleEnvelope, ratio: float, tail: float) -> DiscreteScale:
    """The envelope's ``Z`` (``>= 1``, see `envelope`) rounded up to a grid from 1 up to where ``P(Z > z) <= tail``.

    Consecutive points differ by the factor ``1 + ratio`` while ``P(Z > z) >= COARSE_TAIL``; further out the step
    grows like ``sqrt(COARSE_TAIL / P(Z > z))`` (at most ``MAX_SCALE_STEP``), where the weights are too small for
    the rounding to matter. Any grid rounds up, so this only trades tightness for speed.
    """
    if envelope.exact:
        return DiscreteScale(np.ones(1), np.ones(1), 0.0, 0.0)
    values, survival = [1.0], [float(envelope.sf(1.0))]
    while survival[-1] > tail:
        grow = min(ratio * max(1.0, math.sqrt(COARSE_TAIL / survival[-1])), MAX_SCALE_STEP)
        values.append(values[-1] * (1 + grow))
        survival.append(float(envelope.sf(values[-1])))
    weights = np.empty(len(values))
    weights[0] = envelope.cdf(1.0)
    weights[1:] = np.array(survival[:-1]) - np.array(survival[1:])
    error = SPECIAL_FUNCTION_ERROR * (weights[0] + 2 * sum(survival))
    return DiscreteScale(np.array(values), weights, survival[-1], float(error))


def _loss(x: np.ndarray | float, mu: float, q: float) -> np.ndarray:
    """``log(1 - q + q exp(mu x - mu^2 / 2))`` without overflow."""
    log_rest = math.log1p(-q) if q < 1 else -math.inf
    return np.logaddexp(log_rest, math.log(q) + mu * np.asarray(x) - mu * mu / 2)


def _threshold_offsets(losses: np.ndarray, q: float, remove: bool) -> np.ndarray:
    """``log((exp(+-t) - 1 + q) / q)``: the loss ``t`` is reached at ``x = offset / mu + mu / 2``.

    For remove ``L <= t`` iff ``x <= x_t``; for add ``L <= t`` iff ``x >= x_t``. ``-inf`` where ``t`` lies below
    (remove) or above (add) the support.
    """
    shifted = np.expm1(losses if remove else -losses) + q
    with np.errstate(divide="ignore", invalid="ignore"):
        return np.where(shifted > 0, np.log(np.where(shifted > 0, shifted, 1.0)) - math.log(q), -np.inf)


def _band(mu: float, q: float, remove: bool, cut: float, step: float) -> tuple[int, int]:
    """Loss indices outside which this component holds at most ``cut`` of its mass under ``A``."""
    # A's outcomes are N(0, 1) (with weight 1 - q) and, for remove, N(mu, 1) (weight q).
    reach = float(-ndtri(min(cut, 0.5)))
    x_low, x_high = -reach, (mu if remove else 0.0) + reach
    ends = _loss(np.array([x_low, x_high]), mu, q)
    low, high = (ends[0], ends[1]) if remove else (-ends[1], -ends[0])
    cap = math.ceil(MAX_STEP_LOSS / step)
    return max(math.floor(low / step), -cap), min(math.ceil(high / step), cap)


def _component(
    mu: float, q: float, remove: bool, offsets: np.ndarray, first: int, exp_losses: np.ndarray
) -> tuple[np.ndarray, np.ndarray, float, float, float]:
    """One ``mu`` on its band (loss indices ``first, first + 1, ...``): the ``A``- and ``B``-masses of the
    intervals ``(t_{i-1}, t_i]`` after the first point, ``A(L <= t_first)``, ``A(L > t_last)`` and the sum of the
    CDF values used (for the error bound)."""
    count = len(offsets)
    n_left = min(max(1 - first, 0), count)  # points with t <= 0: CDF side
    first_right = min(max(-first, 0), count)  # points with t >= 0: survival side
    x = offsets / mu + mu / 2  # -inf where the whole support lies above (remove) or below (add) the loss
    sign = 1.0 if remove else -1.0  # remove: L <= t iff X <= x; add: iff X >= x
    x_left, x_right = sign * x[:n_left], sign * x[first_right:]
    base_cdf, shifted_cdf = ndtr(x_left), ndtr(x_left - sign * mu)
    base_sf, shifted_sf = ndtr(-x_right), ndtr(sign * mu - x_right)
    mixed_cdf, mixed_sf = (1 - q) * base_cdf + q * shifted_cdf, (1 - q) * base_sf + q * shifted_sf
    # remove: A = (1 - q) N(0, 1) + q N(mu, 1), B = N(0, 1); add: A = N(0, 1), B = the mixture.
    a_cdf, b_cdf = (mixed_cdf, base_cdf) if remove else (base_cdf, mixed_cdf)
    a_sf, b_sf = (mixed_sf, base_sf) if remove else (base_sf, mixed_sf)
    a_mass, b_mass = np.empty(count - 1), np.empty(count - 1)
    a_mass[: max(n_left - 1, 0)] = np.diff(a_cdf)
    b_mass[: max(n_left - 1, 0)] = np.diff(b_cdf)
    a_mass[first_right:] = -np.diff(a_sf)
    b_mass[first_right:] = -np.diff(b_sf)
    below = a_cdf[0] if n_left else max(1.0 - a_sf[0], 0.0)
    above = a_sf[-1] if first_right < count else max(1.0 - a_cdf[-1], 0.0)
    used = a_cdf.sum() + a_sf.sum() + exp_losses[:n_left] @ b_cdf + exp_losses[first_right:] @ b_sf
    return a_mass, b_mass, float(below), float(above), float(used)


def step_pld(
    noise_multiplier: float,
    sample_rate: float,
    envelope: ScaleEnvelope,
    remove: bool,
    discretization: Discretization,
    scale_tail: float,
    loss_step: Optional[float] = None,
) -> PrivacyLossDistribution:
    """The discretised privacy loss distribution of one step (``remove`` or add direction); ``Z`` is cut where
    ``P(Z > z_max) <= scale_tail``. The grid's step is ``loss_step`` if given, else the discretization's, else
    `MAX_LOSS_STEP` (the coarsest that `loss_steps` tries: one step alone does not accumulate the grid's spread)."""
    if not noise_multiplier > 0:
        raise ValueError(f"noise_multiplier must be > 0, got {noise_multiplier}.")
    if not 0 < sample_rate <= 1:
        raise ValueError(f"sample_rate must be in (0, 1], got {sample_rate}.")
    if loss_step is None:
        loss_step = discretization.loss_step if discretization.loss_step is not None else MAX_LOSS_STEP
    return _discretized_step(float(noise_multiplier), float(sample_rate), envelope, remove, float(loss_step),
                             discretization.scale_ratio, discretization.component_cut, scale_tail)


def loss_steps(
    runs: Sequence[tuple[float, float, int]],
    envelope: ScaleEnvelope,
    remove: bool,
    discretization: Discretization,
    scale_tail: float,
    error_budget: float = math.inf,
) -> Iterator[float]:
    """Steps of the loss grid to try for composing ``runs`` (``(noise_multiplier, sample_rate, steps)``) in one
    direction, coarsest first; the caller stops when a finer grid no longer pays.

    An explicit `Discretization.loss_step` is the only one. Otherwise the first is `MAX_LOSS_STEP`, and each next
    one is ``loss_step_ratio`` times the smallest standard deviation of one step's loss measured on the grid before
    (connect the dots widens it slightly, so it is re-measured on every finer grid), but at least a quarter of the
    step before, at least `MIN_LOSS_STEP`, and coarse enough that the floating-point error bounds of all steps
    (which count grid points and so grow at most like ``1 / step``) are predicted to stay within ``error_budget``.
    The steps end when the next would be less than 30 % finer. Every grid gives an upper bound.
    """
    if discretization.loss_step is not None:
        yield discretization.loss_step
        return
    # The error bound of the Z grid does not depend on the loss grid; the rest grows at most like 1 / step.
    total_steps = sum(steps for _, _, steps in runs)
    fixed = total_steps * discretize_scale(envelope, discretization.scale_ratio, scale_tail).error
    step = MAX_LOSS_STEP
    while True:
        yield step
        plds = [(step_pld(sigma, q, envelope, remove, discretization, scale_tail, step), steps)
                for sigma, q, steps in runs]
        spread = min(pld.mean_and_std()[1] for pld, _ in plds)
        grid_error = max(sum(steps * pld.error for pld, steps in plds) - fixed, 0.0) * step
        affordable = grid_error / (error_budget - fixed) if error_budget > fixed else math.inf
        finer = max(discretization.loss_step_ratio * spread, step / 4, MIN_LOSS_STEP, affordable)
        if finer > 0.7 * step:  # within 1 / 0.7 of the target: the composed loss is about 1 % wider at most
            return
        step = finer


@lru_cache(maxsize=32)
def _discretized_step(
    noise_multiplier: float,
    sample_rate: float,
    envelope: ScaleEnvelope,
    remove: bool,
    step: float,
    scale_ratio: float,
    cut: float,
    scale_tail: float,
) -> PrivacyLossDistribution:
    """`step_pld` on a grid of step ``step``."""
    q = sample_rate
    scale = discretize_scale(envelope, scale_ratio, scale_tail)
    live = scale.weights > cut  # lighter components go to +inf whole
    mus, weights = scale.values[live] / noise_multiplier, scale.weights[live]
    infinity = float(scale.weights[~live].sum())
    bands = [_band(mu, q, remove, cut / weight, step) for mu, weight in zip(mus, weights)]
    # A band wholly above the largest loss kept (possible at q = 1): its component's weight goes to +inf whole.
    beyond = np.array([low > high for low, high in bands], dtype=bool)
    if beyond.any():
        infinity += float(weights[beyond].sum())
        mus, weights = mus[~beyond], weights[~beyond]
        bands = [band for band, gone in zip(bands, beyond) if not gone]
    # Z = inf: remove puts (1 - q) of it at log(1 - q) and q at +inf; add puts all of it at -log(1 - q).
    inf_loss = (math.log1p(-q) if remove else -math.log1p(-q)) if q < 1 else math.inf
    inf_index = math.ceil(inf_loss / step) if math.isfinite(inf_loss) else None
    ends = [*bands, *([(inf_index, inf_index)] if inf_index is not None else [])] or [(0, 0)]
    lowest, highest = min(low for low, _ in ends), max(high for _, high in ends)
    indices = np.arange(lowest, highest + 1)
    offsets = _threshold_offsets(indices * step, q, remove)
    exp_losses = np.exp(indices * step)
    a_mass, b_mass = np.zeros(len(indices)), np.zeros(len(indices))  # [i]: interval (t_{i-1}, t_i]
    pmf = np.zeros(len(indices))
    used = 0.0
    for mu, weight, (low, high) in zip(mus, weights, bands):
        band = slice(low - lowest, high - lowest + 1)
        masses_a, masses_b, below, above, band_used = _component(mu, q, remove, offsets[band], low, exp_losses[band])
        a_mass[low - lowest + 1 : high - lowest + 1] += weight * masses_a
        b_mass[low - lowest + 1 : high - lowest + 1] += weight * masses_b
        pmf[low - lowest] += weight * below
        infinity += weight * above
        used += weight * band_used
    # Connect the dots: a_up at t_i and a_mass - a_up at t_{i-1} keep the interval's A- and B-mass.
    a_up = (a_mass[1:] - exp_losses[:-1] * b_mass[1:]) / -math.expm1(-step)
    a_up = np.clip(a_up, 0.0, a_mass[1:])
    pmf[1:] += a_up
    pmf[:-1] += a_mass[1:] - a_up
    if inf_index is None:
        infinity += scale.tail
    elif remove:
        pmf[inf_index - lowest] += (1 - q) * scale.tail
        infinity += q * scale.tail
    else:
        pmf[inf_index - lowest] += scale.tail
    error = 4 * SPECIAL_FUNCTION_ERROR * used + scale.error + 4 * len(indices) * 2.0**-53
    return PrivacyLossDistribution(step, lowest, pmf, min(infinity, 1.0), error)
