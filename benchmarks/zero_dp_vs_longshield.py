"""The LongShield paper's comparison on this machine: ZeRO-DP+ vs LongShield V2 / V3 vs Opacus ghost clipping, with
their non-DP loops, side by side in one run. Prints JSON (and, with ``--markdown``, the table of docs/benchmarks.md).

    python benchmarks/zero_dp_vs_longshield.py --seq-len 256 --micro-batch-sizes 1 2 4 8 \\
        --budget-mib 600 --budget-seq-lens 256 512 1024 2048 --markdown

Every configuration is one fresh process of ``benchmarks/dp_overhead.py`` (the same loops, data and measurements;
``--repeats`` go round every loop in turn, so a slow spell of the machine does not land on one loop's repeats; with
``--same-process`` each DP loop's process also times its non-DP loop, alternated, and the table shows that ratio):
``zero_dp_plus`` is `LongShieldStrategy(norms="mixed", shard_over="all")` (ZeRO-DP+: FSDP over all ranks, mixed
ghost norms, book-keeping), ``longshield`` materialises per-sample gradients (V2's path at CP 1), ``longshield_v3``
adds DP-safe activation checkpointing, ``opacus_ghost`` is Opacus's ``grad_sample_mode="ghost"``; step-time ratios
are against the matching non-DP loop. Max sequence length: the longest of ``--budget-seq-lens`` whose peak memory
(dp_overhead's measurement: the most bytes of tensors alive at once) stays within ``--budget-mib`` at micro-batch
``--budget-micro-batch-size``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Optional

sys.path.insert(0, str(Path(__file__).resolve().parent))

from dp_overhead import _least_disturbed, _row, largest_within_budget, measure  # noqa: E402

DP_METHODS = ("zero_dp_plus", "longshield", "longshield_v3", "opacus_ghost")
METHODS = ("nondp_lightning", *DP_METHODS[:3], "nondp_torch", DP_METHODS[3])
TABLE_COLUMNS = {"zero_dp_plus": "ZeRO-DP+", "longshield": "LongShield V2", "longshield_v3": "LongShield V3",
                 "opacus_ghost": "Opacus ghost"}


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--accumulation", type=int, default=4, help="micro-batches per optimizer step")
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--precision", default="32-true")
    parser.add_argument("--budget-mib", type=float, default=None, help="memory budget for the max sequence length")
    parser.add_argument("--budget-seq-lens", type=int, nargs="+", default=[256, 512, 1024, 2048])
    parser.add_argument("--budget-micro-batch-size", type=int, default=4)
    parser.add_argument("--same-process", action="store_true",
                        help="time each DP loop against its non-DP loop in one process (dp_overhead's --same-process)")
    parser.add_argument("--markdown", action="store_true", help="also print the table of docs/benchmarks.md")
    return parser.parse_args(argv)


def _flags(args: argparse.Namespace, seq_len: int, steps: int) -> list[str]:
    return [f"--preset={args.preset}", f"--seq-len={seq_len}", f"--accumulation={args.accumulation}",
            f"--warmup={args.warmup}", f"--steps={steps}", f"--device={args.device}",
            f"--precision={args.precision}"]


def step_times(args: argparse.Namespace, methods: tuple[str, ...] = METHODS) -> list[dict[str, Any]]:
    rows = []
    for micro_batch_size in args.micro_batch_sizes:
        flags = [*_flags(args, args.seq_len, args.steps), *(["--same-process"] if args.same_process else [])]
        runs: dict[str, list[dict[str, float]]] = {method: [] for method in methods}
        for _ in range(args.repeats):
            for method in methods:
                runs[method].append(measure(method, micro_batch_size, flags))
        rows.append(_row(micro_batch_size, args.accumulation,
                         {method: _least_disturbed(measured) for method, measured in runs.items()}))
    return rows


def longest_within_budget(args: argparse.Namespace, method: str) -> dict[str, Any]:
    """The longest sequence whose peak memory stays within the budget (lengths tried in increasing order)."""
    longest, peaks = largest_within_budget(
        args.budget_seq_lens, args.budget_mib,
        lambda seq_len: measure(method, args.budget_micro_batch_size, _flags(args, seq_len, steps=1))["peak_mem_bytes"],
    )
    return {"max_seq_len": longest, "peak_mem_mib_by_seq_len": peaks}


def markdown(results: list[dict[str, Any]], budget: dict[str, Any]) -> str:
    header = "| MBS | " + " | ".join(f"{name} step / non-DP" for name in TABLE_COLUMNS.values()) + " |"
    lines = [header, "|" + "---|" * (len(TABLE_COLUMNS) + 1)]
    for row in results:
        cells = [str(row.get(f"{method}_over_nondp_same_process", row.get(f"{method}_over_nondp", "-")))
                 for method in TABLE_COLUMNS]
        lines.append(f"| {row['micro_batch_size']} | " + " | ".join(cells) + " |")
    if budget:
        cells = [str(budget[method]["max_seq_len"]) for method in TABLE_COLUMNS]
        lines.append("| max T within budget | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> dict[str, Any]:
    args = parse_args(argv)
    results = step_times(args)
    budget = {method: longest_within_budget(args, method) for method in DP_METHODS} if args.budget_mib else {}
    output = {"config": {key: value for key, value in vars(args).items() if key != "markdown"},
              "results": results, "within_budget": budget}
    print(json.dumps(output, indent=2))
    if args.markdown:
        print(markdown(results, budget))
    return output


if __name__ == "__main__":
    main()
