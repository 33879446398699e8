"""Tokens per second and peak memory on one GPU: non-DP (Lightning's default strategy), LongShield V2 and V3, and
Opacus hooks, side by side in one run. Prints JSON.

The grid is the one LongShield's GPU targets are stated on: ``llama3.2-1b``, bf16-mixed, AdamW, a logical batch of
``--accumulation`` (default 4) micro-batches, no Poisson sampling, at (T, MBS) = (4096, 1), (4096, 2) and
(16384, 1). Every (configuration, method) runs in a fresh process (``benchmarks/dp_overhead.py``'s worker), so
peak memory is its own; a run that runs out of memory is reported as ``"out_of_memory"``. Ratios:
``longshield_over_nondp`` = LongShield tokens/s / non-DP tokens/s (target >= 0.95 / 0.92 / 0.97),
``longshield_over_opacus`` = LongShield tokens/s / Opacus tokens/s, each in its own loop (Lightning's for
LongShield, a plain PyTorch loop for Opacus, whose loop is the lighter: a conservative ratio; target >= 1.3) and
``longshield_peak_over_nondp`` (peak reserved, target <= 1.03 at MBS 1), and ``noise``: the per-step cost of the
mechanism's keyed noise against the old seeding and secure mode's noise throughput
(``benchmarks/noise_generation.py``). Needs CUDA; ``--device cpu --preset tiny --points 64x1`` runs the same code at
a toy size.

    python benchmarks/gpu_throughput.py                 # the grid above, on cuda
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_overhead import WorkerFailed, measure, ratio  # noqa: E402
from noise_generation import measure_noise  # noqa: E402

from simulate.specs import get_model_spec  # noqa: E402

METHODS = ("nondp_lightning", "longshield", "longshield_v3", "opacus")
DEFAULT_POINTS = ("4096x1", "4096x2", "16384x1")


def _point(text: str) -> tuple[int, int]:
    try:
        seq_len, mbs = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not SEQ_LENxMBS, e.g. 4096x1") from None
    return seq_len, mbs


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="llama3.2-1b", help="LlamaConfig preset")
    parser.add_argument("--points", type=_point, nargs="+", default=[_point(p) for p in DEFAULT_POINTS],
                        help="SEQ_LENxMBS configurations")
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per logical batch")
    parser.add_argument("--precision", choices=("bf16-mixed", "32-true"), default="bf16-mixed")
    parser.add_argument("--warmup", type=int, default=1, help="optimizer steps not timed")
    parser.add_argument("--steps", type=int, default=3, help="timed optimizer steps")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--methods", nargs="+", choices=METHODS, default=list(METHODS))
    parser.add_argument("--profile-dir", help="also profile one step of every Lightning run (after the timed ones) "
                        "and write each table of kernels by device self time to this folder")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; this benchmark measures a GPU (use --device cpu for a toy run).")
    return args


def _run(method: str, seq_len: int, mbs: int, args: argparse.Namespace) -> dict[str, Any]:
    flags = {"--preset": args.preset, "--seq-len": seq_len, "--accumulation": args.accumulation,
             "--warmup": args.warmup, "--steps": args.steps, "--device": args.device, "--precision": args.precision}
    if args.profile_dir and method != "opacus":
        flags["--profile-dir"] = args.profile_dir
    try:
        measured = measure(method, mbs, [f"{flag}={value}" for flag, value in flags.items()])
    except WorkerFailed as failure:  # reported in the results, so that one failure does not lose the other runs
        return {"out_of_memory": True} if failure.out_of_memory else {"failed": str(failure)[-2000:]}
    tokens = args.accumulation * mbs * seq_len
    out = {"tokens_per_s": round(tokens / measured["step_s"], 1), "step_s": round(measured["step_s"], 4),
           "peak_allocated_gib": round(measured["peak_mem_bytes"] / 2**30, 3)}
    if "peak_reserved_bytes" in measured:
        out["peak_reserved_gib"] = round(measured["peak_reserved_bytes"] / 2**30, 3)
    return out


def _ratio(runs: dict[str, dict[str, Any]], numerator: str, denominator: str, key: str) -> Optional[float]:
    return ratio(runs.get(numerator, {}).get(key), runs.get(denominator, {}).get(key))


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    memory_key = "peak_reserved_gib" if args.device == "cuda" else "peak_allocated_gib"
    results = []
    for seq_len, mbs in args.points:
        runs = {}
        for method in args.methods:
            runs[method] = _run(method, seq_len, mbs, args)
            print(json.dumps({"seq_len": seq_len, "micro_batch_size": mbs, method: runs[method]}), file=sys.stderr,
                  flush=True)
        results.append({
            "seq_len": seq_len, "micro_batch_size": mbs, **runs,
            "longshield_over_nondp": _ratio(runs, "longshield", "nondp_lightning", "tokens_per_s"),
            "longshield_v3_over_nondp": _ratio(runs, "longshield_v3", "nondp_lightning", "tokens_per_s"),
            "longshield_over_opacus": _ratio(runs, "longshield", "opacus", "tokens_per_s"),
            "longshield_peak_over_nondp": _ratio(runs, "longshield", "nondp_lightning", memory_key),
        })
    # The mechanism's randomness at the preset's size: keyed default vs the old seeding, and secure mode's ChaCha20.
    noise = measure_noise([get_model_spec(args.preset).num_parameters], torch.device(args.device),
                          secure_elements=2**26 if args.device == "cuda" else 2**20, repeats=2)
    config = {"preset": args.preset, "accumulation": args.accumulation, "precision": args.precision,
              "warmup_steps": args.warmup, "timed_steps": args.steps, "device": args.device,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__}
    print(json.dumps({"config": config, "results": results, "noise": noise}, indent=2))


if __name__ == "__main__":
    main()
