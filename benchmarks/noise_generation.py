"""The cost of the mechanism's secret randomness per DP step, side by side in one run. Prints JSON.

For a model of ``--params`` trainable entries (default: the tiny preset's and Llama 3.2 1B's 1.24e9), drawn as
tensors of at most ``--tensor-elements`` entries (noise is drawn per parameter tensor):

- ``seeded_32bit``: the old default, ``manual_seed(63-bit hash)`` per step (32 secret bits reach the CPU generator);
- ``keyed``: the generators' whole state keyed from SHAKE-256 (`SecretKey.generators`) per step, draws alone;
- ``release``: the whole release of a step, ``sum / B + noise`` over every tensor, as the mechanism forms it
  (`GaussianNoise.add_to_scaled_all`: on CPU one AES-256-CTR keystream over all tensors, in place; on CUDA the fused
  kernel of `privacy.fused_noise` where Triton runs), against ``torch_release``, the keyed generators' draws added by
  torch ops (what ran before: MT19937 on CPU, two Philox streams on CUDA);
- ``secure``: ChaCha20 keyed per tensor with four-draw hardened Gaussians (``secure_mode``), timed on
  ``--secure-elements`` entries and reported as a throughput and an extrapolated per-step time.

Each figure is the best of ``--repeats``. ``keyed_over_seeded`` is the keyed draws' cost against the old seeding's,
``release_over_torch_release`` the mechanism's release against the torch ops'.

    python benchmarks/noise_generation.py                       # CPU, tiny and 1B
    python benchmarks/noise_generation.py --device cuda         # on a GPU (two Philox streams per draw)
"""

from __future__ import annotations

import argparse
import itertools
import json
import secrets
import time
from collections.abc import Callable
from typing import Any, Optional

import torch

from lightning_longshield.privacy.chacha20 import secure_gaussians
from lightning_longshield.privacy.noise import GaussianNoise
from lightning_longshield.privacy.randomness import SecretKey, derive_seed, standard_normal
from simulate.specs import get_model_spec


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--params", type=int, nargs="+", default=None,
                        help="trainable entries per model (default: the tiny preset's and 1.24e9)")
    parser.add_argument("--tensor-elements", type=int, default=2**24, help="largest noise tensor drawn at once")
    parser.add_argument("--secure-elements", type=int, default=2**24, help="entries timed in secure mode")
    parser.add_argument("--repeats", type=int, default=3)
    return parser.parse_args(argv)


def best_of(repeats: int, run: Callable[[], None], device: torch.device) -> float:
    """The least seconds of ``repeats`` calls of ``run``, after one untimed call (first-call costs: allocations,
    kernel loading, the generators' set-up) that would otherwise land on whichever variant is timed first."""
    run()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        run()
        if device.type == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return min(times)


def tensor_sizes(params: int, largest: int) -> list[int]:
    return [largest] * (params // largest) + ([params % largest] if params % largest else [])


def one_step_seeded(sizes: list[int], device: torch.device) -> None:
    generator = torch.Generator(device=device).manual_seed(derive_seed(secrets.randbits(63), "noise", 0))
    for size in sizes:
        torch.normal(0.0, 1.0, (size,), generator=generator, device=device)


def one_step_keyed(sizes: list[int], device: torch.device, key: SecretKey) -> None:
    generators = key.generators(device, "noise", 0)
    for size in sizes:
        standard_normal(generators, (size,), device)


def one_release(totals: list[torch.Tensor], noise: GaussianNoise, step: int) -> None:
    noise.start_step(step)
    noise.add_to_scaled_all(totals, 0.25, 1.0)


def one_torch_release(totals: list[torch.Tensor], key: SecretKey) -> None:
    generators = key.generators(totals[0].device, "noise", 0)
    for total in totals:
        standard_normal(generators, total.shape, total.device).add_(total, alpha=0.25)


def measure_noise(params_list: list[int], device: torch.device, tensor_elements: int = 2**24,
                  secure_elements: int = 2**24, repeats: int = 3) -> dict[str, Any]:
    """Per-step noise time of the old seeding, the keyed draws, the mechanism's release beside the torch ops' and
    secure mode, for each model size, on ``device``."""
    key = SecretKey.fresh()
    results: dict[str, Any] = {}
    for params in params_list:
        sizes = tensor_sizes(params, tensor_elements)
        seeded = best_of(repeats, lambda sizes=sizes: one_step_seeded(sizes, device), device)
        keyed = best_of(repeats, lambda sizes=sizes: one_step_keyed(sizes, device, key), device)
        totals = [torch.zeros(size, device=device) for size in sizes]
        noise, steps = GaussianNoise(device, key), itertools.count()
        release = best_of(repeats, lambda totals=totals, noise=noise, steps=steps: one_release(totals, noise,
                                                                                              next(steps)), device)
        torch_release = best_of(repeats, lambda totals=totals: one_torch_release(totals, key), device)
        del totals
        results[str(params)] = {"seeded_32bit_s": seeded, "keyed_s": keyed, "keyed_over_seeded": keyed / seeded,
                                "release_s": release, "torch_release_s": torch_release,
                                "release_over_torch_release": release / torch_release}
    secure = best_of(repeats, lambda: secure_gaussians(secrets.token_bytes(32), secure_elements, device), device)
    secure_rate = secure_elements / secure
    for params, row in results.items():
        row["secure_s_extrapolated"] = int(params) / secure_rate
        row["secure_over_keyed"] = row["secure_s_extrapolated"] / row["keyed_s"]
    return {
        "device": str(device), "threads": torch.get_num_threads(),
        "keyed_generator_setup_s": best_of(20, lambda: key.generators(device, "noise", 0), device),
        "secure_noise_gb_per_s": 4 * secure_rate / 1e9,
        "per_step": results,
    }


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    params = args.params or [get_model_spec(name).num_parameters for name in ("tiny", "llama3.2-1b")]
    print(json.dumps(measure_noise(params, torch.device(args.device), args.tensor_elements, args.secure_elements,
                                   args.repeats), indent=2))


if __name__ == "__main__":
    main()
