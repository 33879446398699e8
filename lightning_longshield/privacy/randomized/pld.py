"""Pessimistic privacy loss distributions on a grid: composition by FFT and epsilon, both as upper bounds.

A `PrivacyLossDistribution` describes a pair ``(A, B)`` (output distributions with and without a sample) by the
law under ``A`` of the privacy loss ``L = log(dA/dB)``: probabilities ``pmf[i]`` of the losses
``(offset + i) * step`` and an atom at ``+infinity`` (outcomes ``B`` never produces). For ``epsilon >= 0``,

    delta(epsilon) = P_A(L = inf) + sum_i pmf[i] (1 - exp(epsilon - loss_i))_+

(the hockey-stick divergence), and composing mechanisms adds independent losses (convolution).

Every operation here may only make ``delta`` larger:

- `truncated` moves mass below the window up to its lowest loss and mass above it to ``+infinity``. Both are
  dominating pairs (the original pair is a post-processing of the new one), so the bound survives composition.
- `error` bounds the floating-point error of everything computed so far (it is added to every ``delta``):
  FFT convolution per Higham, *Accuracy and Stability of Numerical Algorithms* (2nd ed.), Thm. 24.2, the 1-norm of
  an output error being at most ``sqrt(N)`` times its 2-norm; composition adds the operands' errors (convolving
  with a probability vector does not grow a 1-norm). A ``delta`` is a sum of probabilities weighted by at most 1,
  so an error of at most ``e`` in 1-norm changes it by at most ``e``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
from scipy import fft

UNIT_ROUNDOFF = 2.0**-53
FFT_ETA = 8 * UNIT_ROUNDOFF  # Higham's eta for twiddle factors accurate to a few units in the last place


def _norm2(values: np.ndarray) -> float:
    return float(np.sqrt(np.square(values).sum()))


@dataclass(frozen=True)
class PrivacyLossDistribution:
    """Probabilities of the losses ``(offset + i) * step`` under ``A``, an atom at ``+inf`` and an error bound."""

    step: float
    offset: int
    pmf: np.ndarray
    infinity_mass: float
    error: float

    @property
    def losses(self) -> np.ndarray:
        return (self.offset + np.arange(len(self.pmf))) * self.step

    def mean_and_std(self) -> tuple[float, float]:
        """Mean and standard deviation of the finite part of the loss (for sizing windows)."""
        mass = self.pmf.sum()
        if not mass > 0:
            return 0.0, 0.0
        mean = float(self.pmf @ self.losses / mass)
        return mean, float(np.sqrt(max(self.pmf @ np.square(self.losses - mean) / mass, 0.0)))

    def truncated(self, lower: int, upper: int) -> PrivacyLossDistribution:
        """Restrict to loss indices ``[lower, upper]``: lower mass rounded up to ``lower``, upper mass to ``+inf``."""
        start, end = self.offset, self.offset + len(self.pmf) - 1
        if start >= lower and end <= upper:
            return self
        low, high = max(lower - start, 0), min(upper - start, len(self.pmf) - 1)
        if high < low:  # everything lies above or below the window
            below = float(self.pmf.sum()) if end < lower else 0.0
            pmf = np.array([below])
            return PrivacyLossDistribution(
                self.step, lower, pmf, self.infinity_mass + float(self.pmf.sum()) - below, self.error
            )
        pmf = self.pmf[low : high + 1].copy()
        pmf[0] += self.pmf[:low].sum()
        return PrivacyLossDistribution(
            self.step, start + low, pmf, self.infinity_mass + float(self.pmf[high + 1 :].sum()), self.error
        )

    def compose(self, other: PrivacyLossDistribution, lower: int, upper: int) -> PrivacyLossDistribution:
        """The pair of both mechanisms run independently, truncated to loss indices ``[lower, upper]``."""
        if other.step != self.step:
            raise ValueError("Only distributions on the same grid compose.")
        size = len(self.pmf) + len(other.pmf) - 1
        padded = 1 << (size - 1).bit_length()
        pmf = fft.irfft(fft.rfft(self.pmf, padded) * fft.rfft(other.pmf, padded), padded)[:size]
        # Forward transforms, product and inverse each err by at most `relative` in 2-norm (Parseval bounds the
        # transforms of the operands by their 1- and 2-norms); the 1-norm of the error is <= sqrt(N) times that.
        relative = math.log2(padded) * FFT_ETA / (1 - math.log2(padded) * FFT_ETA)
        norms = _norm2(self.pmf) * np.abs(other.pmf).sum() + np.abs(self.pmf).sum() * _norm2(other.pmf)
        fft_error = 3 * relative * norms * math.sqrt(padded)
        # True probabilities are >= 0: clipping the FFT's round-off below 0 moves each entry towards its true value.
        np.maximum(pmf, 0.0, out=pmf)
        infinity = self.infinity_mass + other.infinity_mass - self.infinity_mass * other.infinity_mass
        error = self.error * (1 + other.error) + other.error + fft_error
        composed = PrivacyLossDistribution(self.step, self.offset + other.offset, pmf, infinity, error)
        return composed.truncated(lower, upper)

    def self_compose(self, times: int, lower: int, upper: int) -> PrivacyLossDistribution:
        """``times`` independent runs (binary powering), truncated to ``[lower, upper]`` after every convolution."""
        if times < 1:
            raise ValueError(f"times must be >= 1, got {times}.")
        result = None
        power = self.truncated(lower, upper)
        while True:
            if times & 1:
                result = power if result is None else result.compose(power, lower, upper)
            times >>= 1
            if not times:
                return result
            power = power.compose(power, lower, upper)

    def delta(self, epsilon: float) -> float:
        """Upper bound on ``delta`` at ``epsilon`` (floating-point error included)."""
        losses = self.losses
        above = losses > epsilon
        hockey = self.pmf[above] @ -np.expm1(epsilon - losses[above])
        return float(self.infinity_mass + hockey + self.error + self._summation_error())

    def epsilon(self, delta: float) -> float:
        """The smallest ``epsilon >= 0`` whose `delta` is at most ``delta`` (``inf`` if none)."""
        budget = delta - self.infinity_mass - self.error - self._summation_error()
        if budget <= 0:
            return math.inf
        losses = self.losses
        positive = losses > 0
        losses, pmf = losses[positive], self.pmf[positive]
        # Suffix sums over the losses >= losses[i]: A-mass and B-mass (A-mass times exp(-loss)).
        mass = np.cumsum(pmf[::-1])[::-1]
        b_mass = np.cumsum((pmf * np.exp(-losses))[::-1])[::-1]
        if not len(pmf) or mass[0] - b_mass[0] <= budget:  # delta(0)
            return 0.0
        # delta(losses[i]) counts the losses above losses[i]; it is 0 at the last one, so some index qualifies.
        at_grid = np.append(mass[1:], 0.0) - np.exp(losses) * np.append(b_mass[1:], 0.0)
        index = int(np.argmax(at_grid <= budget))
        # Between the previous grid loss (or 0) and losses[index], delta(eps) = mass[index] - exp(eps) b_mass[index].
        return math.log((mass[index] - budget) / b_mass[index])

    def _summation_error(self) -> float:
        return 4 * len(self.pmf) * UNIT_ROUNDOFF
