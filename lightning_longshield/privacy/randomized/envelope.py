"""Worst-case distribution of the sensitivity scale ``Z = true norm / estimated norm`` under randomized clipping.

DP-SGD with randomized clipping scales a sample's gradient ``g`` by ``min(1, C / n_hat)``, where ``n_hat`` is a
randomized estimate of ``||g||``. The clipped gradient has norm at most ``C Z`` with ``Z = ||g|| / n_hat``, so one
step is the Gaussian mechanism with a random sensitivity: the pair ``(Z, N(Z / sigma, 1))`` against
``(Z, N(0, 1))`` (summary of DP-SGD-RC, "f-DP Privacy Accounting via Chi-Square Mixture Envelope"). Releasing
``Z`` alongside the output can only help an adversary, so this pair is a valid (conservative) description.

Hutchinson with ``k`` Gaussian projections (entries ``N(0, 1/k)``) estimates ``n^2 = trace(O)``, ``O`` the
Gram matrix of the per-sample gradient with eigenvalues ``lambda``, by ``sum_i lambda_i chi2_i(k) / k``
(independent chi-squares; summary, "Hutchinson Randomized Projection" and ``Z^2(lambda)`` in the accounting
section). With ``lambda`` normalised onto the simplex, ``Z^2 = 1 / S`` and ``S = sum_i lambda_i W_i``,
``W_i ~ chi2(k) / k`` i.i.d. with mean 1, hence

    P(Z <= z) = P(S >= 1 / z^2).

The envelope is the pointwise infimum of this CDF over all spectra (every dimension): a CDF below every
achievable one, i.e. a stochastically largest ``Z``. Its value is ``1 - sup_lambda P(S < y)`` at ``y = 1 / z^2``:

- ``z >= 1`` (``y <= 1``): the supremum is attained by a single chi-square, ``lambda = e_1``, so
  ``P(Z <= z) = P(chi2(k) >= k / z^2)``. This is the right-hand (large ``z``) segment of the three-segment
  envelope that the paper proves (summary, "Chi-Square Mixture Envelope"; it corrects the middle segment of
  Szekely & Bakirov, "Extremal probabilities for Gaussian quadratic forms", PTRF 126, 2003, whose supremum for
  ``1 < y < 2`` is a two-element mixture). It is taken from there, not re-proven here: local optimality is
  elementary (the derivative of ``P((1 - a) W_1 + a W_2 < y)`` at ``a = 0`` is ``-f_W(y) (1 - y) < 0``), and the
  tests check the envelope against Monte Carlo for random spectra.
- ``z < 1`` (``y > 1``): equal weights over ``d`` coordinates give ``P(chi2(dk) / (dk) < y) -> 1`` as
  ``d -> infinity`` (law of large numbers), so the dimension-free envelope is 0 there. The summary's finite-``d``
  left and middle segments (equal weights, two-element mixtures) only lower the sensitivity below ``C``; a
  whole model's gradient spectrum has millions of coordinates, where they vanish, so they are not used.

Hutch++ (conservative variant of the summary, "Limitations"): the adversary is given the head basis ``Q``, whose
part ``h = trace(Q^T O Q) / trace(O)`` is then exact, and Hutchinson with ``k`` projections estimates the rest:
``S = h + (1 - h) S'``. For ``y <= 1``, ``P(S < y) = P(S' < (y - h) / (1 - h)) <= P(S' < y)``, and ``h -> 1``
gives ``P(S < y) = 1`` for ``y > 1``: the envelope equals Hutchinson's dimension-free one with ``k`` the number of
projections of the residual (Hutchinson) part. The same argument covers layers whose norms are computed exactly
(a deterministic share of ``S``).

Requirements for the analysis to hold: Gaussian projections (not Rademacher), drawn fresh at every step and
independent of the data.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
from scipy import stats

ESTIMATORS = ("hutchinson", "hutch++")


@dataclass(frozen=True)
class ScaleEnvelope:
    """The stochastically largest ``Z`` for an estimator with ``projections`` Gaussian projections.

    ``projections=None`` is exact clipping (``Z = 1``). For ``"hutch++"``, ``projections`` counts the projections
    of its Hutchinson (residual) part.
    """

    estimator: str
    projections: Optional[int]

    def __post_init__(self) -> None:
        if self.projections is None:
            if self.estimator != "exact":
                raise ValueError(f"estimator={self.estimator!r} needs a number of projections.")
            return
        if self.estimator not in ESTIMATORS:
            raise ValueError(f"estimator={self.estimator!r} is not supported; choose one of {ESTIMATORS}.")
        if int(self.projections) != self.projections or self.projections < 1:
            raise ValueError(f"projections must be a positive integer, got {self.projections}.")

    @property
    def exact(self) -> bool:
        return self.projections is None

    def cdf(self, z: np.ndarray) -> np.ndarray:
        """``P(Z <= z)``, a lower bound on the CDF of ``Z`` for every spectrum."""
        z = np.asarray(z, dtype=np.float64)
        if self.exact:
            return (z >= 1.0).astype(np.float64)
        k = self.projections
        with np.errstate(divide="ignore"):
            return np.where(z >= 1.0, stats.chi2.sf(k / np.square(z), k), 0.0)

    def sf(self, z: np.ndarray) -> np.ndarray:
        """``P(Z > z) = 1 - cdf(z)``, computed directly so that it stays accurate in the tail."""
        z = np.asarray(z, dtype=np.float64)
        if self.exact:
            return (z < 1.0).astype(np.float64)
        k = self.projections
        with np.errstate(divide="ignore"):
            return np.where(z >= 1.0, stats.chi2.cdf(k / np.square(z), k), 1.0)


EXACT_CLIPPING = ScaleEnvelope("exact", None)


def scale_envelope(estimator: str, projections: Optional[int]) -> ScaleEnvelope:
    """The envelope for ``estimator`` (``"exact"``, ``"hutchinson"`` or ``"hutch++"``) with ``projections``."""
    if estimator == "exact":
        return EXACT_CLIPPING
    if projections is None:
        raise ValueError(f"estimator={estimator!r} needs projections=k.")
    return ScaleEnvelope(estimator, int(projections))
