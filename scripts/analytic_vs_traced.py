"""The analytic memory model against the traced real strategy on a grid; prints README's markdown table.

    python scripts/analytic_vs_traced.py --jobs 2 --json grid.jsonl   # the full grid (96 traces); every point,
                                                                      # with both breakdowns, as a JSON line
    python scripts/analytic_vs_traced.py --models llama3.2-1b --cp 1  # part of the grid
    python scripts/analytic_vs_traced.py --from-json grid.jsonl       # the table of saved points, no tracing
    python scripts/analytic_vs_traced.py --zero-dp --models llama3.2-1b  # ZeRO-DP+ over 8 GPUs, MBS 1-8, short T

Each point traces one DP step of rank 0 (`lightning_longshield.traced_memory.trace_step`, in a fresh process) and
compares its peak with the analytic model's allocated peak (`simulate.estimate_memory(...).allocated`: the same
tensors, without allocator fragmentation or the CUDA context, which fake tensors cannot show) for the method the
strategy really runs (`simulate.config.as_run_by_longshield`: V1 at micro-batch 1 takes V2's path). ``--from-json``
re-does the analytic side with the current model and keeps the saved traces.
"""

from __future__ import annotations

import argparse
import itertools
import json
import multiprocessing
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from simulate import estimate_memory  # noqa: E402
from simulate.config import as_run_by_longshield, longshield_config  # noqa: E402

MODELS = ("llama3.2-1b", "llama3.1-8b")
METHODS = ("nondp-cp", "v1", "v2", "v3")
CP_SIZES = (1, 4)
MICRO_BATCH_SIZES = (1, 2)
SEQ_LENS = (4096, 16384, 65536)
ZERO_DP_DATA_PARALLEL = 8  # ZeRO-DP+: CP 1, model states sharded over 8 data-parallel GPUs
ZERO_DP_MICRO_BATCH_SIZES = (1, 2, 4, 8)
ZERO_DP_SEQ_LENS = (256, 1024, 4096)
TOLERANCE = 0.10
# Saved points without a loss_chunk_tokens field were traced with the whole logits (before the chunked loss).
WHOLE_LOGITS = None
SHORT = {"llama3.2-1b": "1B", "llama3.1-8b": "8B"}


Point = tuple[str, str, int, int, int, int]  # model, method, CP, MBS, T, data-parallel size


def trace_point(point: Point) -> dict[str, object]:
    """Trace one point (GiB)."""
    from lightning_longshield.traced_memory import trace_step

    model, method, cp, mbs, seq_len, data_parallel = point
    traced = trace_step(model=model, method=method, cp=cp, data_parallel=data_parallel, mbs=mbs, seq_len=seq_len)
    return {"model": model, "method": method, "cp": cp, "mbs": mbs, "seq_len": seq_len,
            "data_parallel": data_parallel, "loss_chunk_tokens": _traced_loss_chunking(),
            "traced_gib": traced.total / 2**30,
            "traced_breakdown_gib": traced.as_gib(), "trace_seconds": traced.seconds}


def _traced_loss_chunking() -> object:
    """The loss chunking a trace runs: `CausalLMModule`'s default (the trace builds the module with it)."""
    import inspect

    from lightning_longshield import CausalLMModule

    return inspect.signature(CausalLMModule).parameters["loss_chunk_tokens"].default


def with_analytic(row: dict[str, object]) -> dict[str, object]:
    """``row`` with the analytic prediction of its configuration and the relative error beside the trace."""
    analytic = estimate_memory(longshield_config(row["model"], row["method"], row["cp"], row["mbs"], row["seq_len"],
                                                 data_parallel=row.get("data_parallel", 1),
                                                 loss_chunk_tokens=row.get("loss_chunk_tokens", WHOLE_LOGITS)))
    method = as_run_by_longshield(row["method"], row["mbs"])
    return {**row, "analytic_method": method, "analytic_gib": analytic.allocated / 2**30,
            "error": analytic.allocated / 2**30 / row["traced_gib"] - 1,
            "analytic_breakdown_gib": analytic.as_gib(), "analytic_phase": analytic.phase}


def grid(models: tuple[str, ...] = MODELS, cp_sizes: tuple[int, ...] = CP_SIZES) -> list[Point]:
    return list(itertools.product(models, METHODS, cp_sizes, MICRO_BATCH_SIZES, SEQ_LENS, (1,)))


def zero_dp_grid(models: tuple[str, ...] = MODELS) -> list[Point]:
    return list(itertools.product(models, ("zero-dp",), (1,), ZERO_DP_MICRO_BATCH_SIZES, ZERO_DP_SEQ_LENS,
                                  (ZERO_DP_DATA_PARALLEL,)))


def _grid_order(row: dict[str, object]) -> tuple[object, ...]:
    methods = (*METHODS, "zero-dp")
    return (MODELS.index(row["model"]), methods.index(row["method"]), row["cp"], row["mbs"], row["seq_len"])


def _length(tokens: int) -> str:
    return f"{tokens // 1024}k" if tokens >= 1024 else str(tokens)


def markdown(rows: list[dict[str, object]]) -> str:
    """One row per (model, method, CP, MBS), one column per T: traced / analytic GiB (error)."""
    lengths = sorted({r["seq_len"] for r in rows})
    header = " | ".join(f"T={_length(t)}: traced / analytic GiB" for t in lengths)
    lines = [f"| model | method | CP | MBS | {header} |", "|---|---|---|---|" + "---|" * len(lengths)]
    cells: dict[tuple[object, ...], dict[int, str]] = {}
    for r in rows:
        mark = "" if abs(r["error"]) <= TOLERANCE else " ✗"
        method = r["method"] + ("\\*" if r["analytic_method"] != r["method"] else "")
        data_parallel = r.get("data_parallel", 1)
        cp = f"1 (DP {data_parallel})" if r["method"] == "zero-dp" else r["cp"]
        key = (SHORT.get(r["model"], r["model"]), method, cp, r["mbs"])
        cells.setdefault(key, {})[r["seq_len"]] = (
            f"{r['traced_gib']:.1f} / {r['analytic_gib']:.1f} ({100 * r['error']:+.1f}%{mark})")
    for key, by_length in cells.items():
        row = [*map(str, key), *(by_length.get(t, "") for t in lengths)]
        lines.append("| " + " | ".join(row) + " |")
    within = sum(abs(r["error"]) <= TOLERANCE for r in rows)
    lines.append("")
    lines.append(f"{within} of {len(rows)} points within {TOLERANCE:.0%}.")
    if any(r["analytic_method"] != r["method"] for r in rows):
        lines[-1] += (" \\* V1 at micro-batch 1 runs V2's path (the sample's gradient is FSDP's gradient shard) and"
                      " is compared with the analytic V2.")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=1, help="traces run in parallel (each needs about 2 GiB)")
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--cp", type=int, nargs="+", choices=CP_SIZES, default=list(CP_SIZES), help="CP sizes")
    parser.add_argument("--zero-dp", action="store_true",
                        help=f"trace ZeRO-DP+ over {ZERO_DP_DATA_PARALLEL} GPUs instead (MBS 1-8, T 256-4k)")
    parser.add_argument("--json", type=Path, help="append every point, with both breakdowns, as a JSON line")
    parser.add_argument("--from-json", type=Path, nargs="+", help="print the table of these saved points instead")
    args = parser.parse_args()
    if args.from_json:
        rows = [json.loads(line) for path in args.from_json for line in path.read_text().splitlines() if line]
    else:
        rows = []
        context = multiprocessing.get_context("spawn")
        with context.Pool(args.jobs, maxtasksperchild=1) as pool:  # a fresh process (and process group) per trace
            points = zero_dp_grid(tuple(args.models)) if args.zero_dp else grid(tuple(args.models), tuple(args.cp))
            for row in pool.imap_unordered(trace_point, points):
                rows.append(row)
                if args.json:
                    with args.json.open("a") as out:
                        out.write(json.dumps(row) + "\n")
    print(markdown(sorted((with_analytic(row) for row in rows), key=_grid_order)))


if __name__ == "__main__":
    main()
