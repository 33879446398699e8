"""What the noise's floating-point cut-off adds to delta.

Floating-point Gaussians end where their uniforms' smallest value puts them: Box-Muller's radius ``sqrt(-2 ln u)``
reaches ``sqrt(2 b ln 2)`` for ``b``-bit uniforms. Each noise source (`NoiseTail`) releases the sum of ``terms`` such
normals, each cut off at ``cut_off`` standard deviations, over ``sqrt(terms)``: it never exceeds ``m = cut_off
sqrt(terms)``. A release beyond ``m`` from where the data without one sample would put it shows that sample's
presence. With the sample's clipped gradient ``a`` (in units of the noise's standard deviation, ``|a| <= s = 1 /
noise_multiplier``) that happens in coordinate ``i`` with probability ``f(a_i) = P(Z > m - a_i)``.

- One term (the CPU keystream): ``f(a) <= a phi(cut_off - a)`` (``phi`` the normal density). For any threshold ``t``,
  at most ``s^2 / t^2`` coordinates have ``a_i > t``, each at most ``Q(cut_off - s)`` (``Q`` the normal tail), and
  the others together at most ``sqrt(d) s phi(cut_off - t)`` (``sum a_i <= sqrt(d) |a|``); the bound is the least over
  thresholds, with ``d = COORDINATES``.
- Two terms (Philox on GPUs; ``secure_mode``, whose two Box-Muller pairs each give ``r (cos t + sin t) = sqrt(2) r
  sin(t + pi / 4)``, one normal of radius ``r``): the sum's density falls to zero at ``m``, so ``f(a) / a^2`` grows
  with ``a`` and ``sum f(a_i) <= f(s)``: the whole shift on one coordinate is the worst case, computed by
  integration.

Over a run it counts once per step the sample is in: ``steps q`` of them in expectation under Poisson sampling. This
is the continuous truncated Gaussian's account; the rounding of fp32 values is what ``secure_mode``'s hardening is for.
"""

from __future__ import annotations

import math
from typing import NamedTuple

#: The coordinates of one release the one-term bound assumes: 2^40, beyond any model trained here.
COORDINATES = 2**40
_THRESHOLDS = 200
_INTEGRATION_POINTS = 2000


class NoiseTail(NamedTuple):
    """A noise source's normals: ``terms`` of them, each cut off at ``cut_off`` standard deviations, summed over
    ``sqrt(terms)`` per released value."""

    terms: int
    cut_off: float


#: The CPU keystream's 62-bit radius uniforms (`keystream_normals`).
KEYSTREAM_TAIL = NoiseTail(1, math.sqrt(124 * math.log(2)))
#: Two keyed Philox streams, the fused kernel's and cuRAND's (torch's CUDA ``normal_``) uniforms ``(x + 1/2) 2^-32``.
PHILOX_TAIL = NoiseTail(2, math.sqrt(66 * math.log(2)))
#: ``secure_mode``: two normals from 53-bit uniforms (`chacha20.hardened_gaussians`: four draws, two radii).
SECURE_TAIL = NoiseTail(2, math.sqrt(106 * math.log(2)))


def normal_tail(x: float) -> float:
    """``P(N(0, 1) > x)``."""
    return 0.5 * math.erfc(x / math.sqrt(2))


def normal_density(x: float) -> float:
    return math.exp(-0.5 * x * x) / math.sqrt(2 * math.pi)


def per_step_cut_off_delta(tail: NoiseTail, noise_multiplier: float) -> float:
    """The probability, in one step that a sample is in, that a release shows it beyond the noise's cut-off (the
    module's bound, at most 1)."""
    if noise_multiplier <= 0:
        raise ValueError(f"The noise multiplier must be positive, not {noise_multiplier}.")
    shift = 1.0 / noise_multiplier
    if tail.terms == 1:
        return min(1.0, _one_term_bound(tail.cut_off, shift))
    if tail.terms == 2:
        return min(1.0, _pair_tail(tail.cut_off, shift * math.sqrt(2)))
    raise ValueError(f"No bound for a sum of {tail.terms} normals.")


def cut_off_delta(tail: NoiseTail, noise_multiplier: float, sample_rate: float, steps: float) -> float:
    """`per_step_cut_off_delta` over ``steps`` steps of Poisson sampling at ``sample_rate`` (at most 1)."""
    return min(1.0, steps * sample_rate * per_step_cut_off_delta(tail, noise_multiplier))


def _one_term_bound(cut_off: float, shift: float) -> float:
    if shift >= cut_off:
        return 1.0
    concentrated, root_d = normal_tail(cut_off - shift), math.sqrt(COORDINATES)
    best = root_d * shift * normal_density(cut_off - shift)  # every coordinate below t = shift
    for index in range(_THRESHOLDS):
        threshold = shift * 10.0 ** (-6 * index / _THRESHOLDS)  # from the shift down to a millionth of it
        above = min(float(COORDINATES), (shift / threshold) ** 2)
        best = min(best, above * concentrated + root_d * shift * normal_density(cut_off - threshold))
    return best


def _pair_tail(cut_off: float, margin: float) -> float:
    """``P(x + y > 2 cut_off - margin)`` for independent normals ``x, y`` cut off at ``cut_off`` (renormalised),
    by Simpson's rule over ``x`` in ``[cut_off - margin, cut_off]``."""
    if margin <= 0:
        return 0.0
    low = max(cut_off - margin, -cut_off)
    mass = 1.0 - 2.0 * normal_tail(cut_off)

    def integrand(x: float) -> float:  # the density of x times P(y in (2 cut_off - margin - x, cut_off])
        inner = max(2 * cut_off - margin - x, -cut_off)
        return normal_density(x) * max(0.0, normal_tail(inner) - normal_tail(cut_off))

    width = (cut_off - low) / _INTEGRATION_POINTS
    total = integrand(low) + integrand(cut_off)
    for index in range(1, _INTEGRATION_POINTS):
        total += (4 if index % 2 else 2) * integrand(low + index * width)
    return total * width / 3 / mass**2
