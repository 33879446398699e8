"""Time of epsilon and of noise calibration with the default (PRV) accountant across the documented range.

For each (sigma, q, steps) it prints the epsilon, the seconds it took, and how long Opacus's own `PRVAccountant`
would have needed for its grid (its grid size, computed without running it: runs that need billions of points are
not attempted). Calibration is timed for a few targets. One JSON object on stdout:

    python benchmarks/accounting_speed.py
"""

from __future__ import annotations

import itertools
import json
import math
import time
import warnings

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


def main() -> None:
    rows = []
    for sigma, q, steps in itertools.product(SIGMAS, RATES, STEPS):
        start = time.perf_counter()
        value = epsilon([(sigma, q, steps)], DELTA, "prv")
        rows.append({"sigma": sigma, "q": q, "steps": steps, "epsilon": value,
                     "seconds": round(time.perf_counter() - start, 3),
                     "opacus_grid_points": float(f"{opacus_grid_points(sigma, q, steps):.3g}")})
    calibrations = []
    for target, q, steps in CALIBRATIONS:
        start = time.perf_counter()
        sigma = calibrate_noise_multiplier(target, DELTA, q, steps, "prv")
        calibrations.append({"target_epsilon": target, "q": q, "steps": steps, "sigma": round(sigma, 4),
                             "seconds": round(time.perf_counter() - start, 3)})
    print(json.dumps({
        "delta": DELTA,
        "get_epsilon": rows,
        "max_get_epsilon_seconds": max(r["seconds"] for r in rows),
        "calibration": calibrations,
        "max_calibration_seconds": max(c["seconds"] for c in calibrations),
    }, indent=1))


if __name__ == "__main__":
    main()
