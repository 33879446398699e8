"""Per-layer vs flat clipping on this machine: LongShield flat, LongShield per-layer (PyTorch path; on CUDA also the
fused Triton kernel), non-DP and Opacus hooks, side by side in one run. Prints JSON (and, with ``--markdown``,
the table of docs/benchmarks.md).

    python benchmarks/per_layer_clipping.py --seq-len 256 --micro-batch-sizes 8 --accumulation 4 \\
        --repeats 3 --budget-mib 400 --budget-micro-batch-sizes 1 2 4 8 16 32 --markdown

Every configuration is one fresh process of ``benchmarks/dp_overhead.py`` (the same loops, data and measurements):
``longshield`` clips each sample's whole gradient (flat), ``longshield_per_layer`` is
`LongShieldStrategy(clipping=PerLayerClipping(kernel="torch"))` (equal thresholds; per-sample gradients
materialised, clipped and freed one layer at a time), ``longshield_per_layer_fused`` the same with
``PerLayerClipping(kernel="triton")`` (linear weights through the fused kernel; only with ``--device cuda``),
``opacus`` is
Opacus's ``grad_sample_mode="hooks"`` (flat clipping, every layer's ``grad_sample`` held). Step-time and peak-memory
ratios are against the matching non-DP loop (``nondp_lightning``, or ``nondp_torch`` for Opacus); per-sample MiB is
the most per-sample-gradient memory held at once; with ``--same-process`` the table's step times are each DP loop's
against its non-DP loop alternated in one process. Largest micro-batch: the largest of
``--budget-micro-batch-sizes`` whose peak memory (dp_overhead's measurement: the most bytes of tensors alive at
once) stays within ``--budget-mib``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dp_overhead import PRECISIONS, largest_within_budget, measure  # noqa: E402
from zero_dp_vs_longshield import _flags, step_times  # noqa: E402

# method -> (README name, its non-DP loop)
TABLE_ROWS = {
    "nondp_lightning": ("Non-DP", "nondp_lightning"),
    "longshield": ("LongShield flat", "nondp_lightning"),
    "longshield_per_layer": ("LongShield per-layer", "nondp_lightning"),
    "longshield_per_layer_fused": ("LongShield per-layer, fused Triton", "nondp_lightning"),
    "opacus": ("Opacus hooks (flat)", "nondp_torch"),
}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[8])
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", choices=PRECISIONS, default="32-true")
    parser.add_argument("--budget-mib", type=float, default=None, help="memory budget for the largest micro-batch")
    parser.add_argument("--budget-micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    parser.add_argument("--same-process", action="store_true",
                        help="time each DP loop against its non-DP loop in one process (dp_overhead's --same-process)")
    parser.add_argument("--markdown", action="store_true", help="also print the table of docs/benchmarks.md")
    return parser.parse_args(argv)


def methods(device: str) -> tuple[str, ...]:
    """The measured loops: the fused kernel only on CUDA."""
    fused = ("longshield_per_layer_fused",) if device == "cuda" else ()
    return ("nondp_lightning", "longshield", "longshield_per_layer", *fused, "nondp_torch", "opacus")


def largest_micro_batch_within_budget(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The largest micro-batch whose peak memory stays within the budget (sizes tried in increasing order)."""
    largest, peaks = largest_within_budget(
        args.budget_micro_batch_sizes, args.budget_mib,
        lambda size: measure(method, size, _flags(args, args.seq_len, steps=1))["peak_mem_bytes"],
    )
    return {"max_micro_batch_size": largest, "peak_mem_mib_by_micro_batch_size": peaks}


def _ratio_cell(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.2f}x"


def markdown(results: list[dict[str, Any]], budget: dict[str, Any], budget_mib: Optional[float]) -> str:
    columns = ["Method", "step time / non-DP", "peak memory / non-DP", "per-sample gradients held (MiB)"]
    if budget:
        columns.append(f"largest MBS within {budget_mib:g} MiB")
    several = len(results) > 1
    if several:
        columns.insert(0, "MBS")
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in results:
        for method, (name, nondp) in TABLE_ROWS.items():
            if f"{method}_step_s" not in row:
                continue
            if method == nondp:
                step, memory = 1.0, 1.0
            else:
                step = row.get(f"{method}_over_nondp_same_process", row.get(f"{method}_over_nondp"))
                memory = row.get(f"{method}_peak_mem_over_nondp")
            held = row.get(f"{method}_per_sample_grad_mib")
            cells = [name, _ratio_cell(step), _ratio_cell(memory), "-" if held is None else f"{held:.1f}"]
            if budget:
                largest = budget[method]["max_micro_batch_size"] if method in budget else None
                cells.append("-" if largest is None else str(largest))
            if several:
                cells.insert(0, str(row["micro_batch_size"]))
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    measured = methods(args.device)
    results = step_times(args, measured)
    budget = {}
    if args.budget_mib:
        budget = {method: largest_micro_batch_within_budget(args, method) for method in measured
                  if method in TABLE_ROWS}
    config = {key: value for key, value in vars(args).items() if key != "markdown"}
    output = {"config": {**config, "methods": list(measured)}, "results": results, "within_budget": budget}
    print(json.dumps(output, indent=2))
    if args.markdown:
        print(markdown(results, budget, args.budget_mib))
    return output


if __name__ == "__main__":
    main()
