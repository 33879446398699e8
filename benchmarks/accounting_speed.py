"""Time of epsilon and of noise calibration with the default (PRV) accountant across the documented range.

For each (sigma, q, steps) it prints the epsilon, the seconds it took, and the grid Opacus's own `PRVAccountant`
needs (computed without running it). Where that grid has at most ``--opacus-most-points`` points, Opacus's
`PRVAccountant.get_epsilon` runs too, side by side, and the row has its seconds, its epsilon and
``opacus_over_ours`` (its time over ours); runs that need billions of points are not attempted. Calibration is timed
for a few targets. One JSON object on stdout:

    python benchmarks/accounting_speed.py
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import time
import warnings

from opacus.accountants import PRVAccountant
from opacus.accountants.analysis.prv import PoissonSubsampledGaussianPRV, compute_safe_domain_size

from lightning_longshield.privacy.epsilon import PRV_EPS_ERROR, calibrate_noise_multiplier, epsilon

DELTA = 1e-6
SIGMAS = (0.3, 1.0, 5.0, 20.0)
RATES = (1e-5, 1e-3, 0.05, 0.5)
STEPS = (1_000, 100_000)
CALIBRATIONS = ((1.0, 0.01, 10_000), (8.0, 1e-3, 100_000), (8.0, 1e-5, 100_000), (3.0, 0.5, 1_000))


def opacus_grid_points(sigma: float, q: float, steps: int) -> float:
    """The number of grid points Opacus's `PRVAccountant.get_epsilon` (default accuracy) would discretise."""
    delta_error = DELTA / 1000
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        half_width = compute_safe_domain_size(
            [PoissonSubsampledGaussianPRV(q, sigma)], [steps], PRV_EPS_ERROR, delta_error
        )
    return 2 * half_width * math.sqrt(steps * math.log(12 / delta_error) / 2) / PRV_EPS_ERROR


def opacus_epsilon(sigma: float, q: float, steps: int) -> tuple[float, float]:
    """Opacus's `PRVAccountant.get_epsilon` at the default accuracy, and the seconds it took."""
    accountant = PRVAccountant()
    accountant.history = [(sigma, q, steps)]
    start = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        value = accountant.get_epsilon(DELTA, eps_error=PRV_EPS_ERROR)
    return value, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--opacus-most-points", type=float, default=2**24,
                        help="run Opacus's PRVAccountant side by side where its grid has at most this many points")
    args = parser.parse_args()
    rows = []
    for sigma, q, steps in itertools.product(SIGMAS, RATES, STEPS):
        start = time.perf_counter()
        value = epsilon([(sigma, q, steps)], DELTA, "prv")
        row = {"sigma": sigma, "q": q, "steps": steps, "epsilon": value,
               "seconds": round(time.perf_counter() - start, 3),
               "opacus_grid_points": float(f"{opacus_grid_points(sigma, q, steps):.3g}")}
        if row["opacus_grid_points"] <= args.opacus_most_points:
            theirs, seconds = opacus_epsilon(sigma, q, steps)
            row.update(opacus_epsilon=theirs, opacus_seconds=round(seconds, 3),
                       opacus_over_ours=round(seconds / max(row["seconds"], 1e-3), 2))
        rows.append(row)
    calibrations = []
    for target, q, steps in CALIBRATIONS:
        start = time.perf_counter()
        sigma = calibrate_noise_multiplier(target, DELTA, q, steps, "prv")
        calibrations.append({"target_epsilon": target, "q": q, "steps": steps, "sigma": round(sigma, 4),
                             "seconds": round(time.perf_counter() - start, 3)})
    compared = [r for r in rows if "opacus_over_ours" in r]
    print(json.dumps({
        "delta": DELTA,
        "get_epsilon": rows,
        "max_get_epsilon_seconds": max(r["seconds"] for r in rows),
        "opacus_over_ours_median": statistics.median(r["opacus_over_ours"] for r in compared) if compared else None,
        "compared_with_opacus": len(compared),
        "calibration": calibrations,
        "max_calibration_seconds": max(c["seconds"] for c in calibrations),
    }, indent=1))


if __name__ == "__main__":
    main()
