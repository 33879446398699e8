"""Print the markdown predicted-vs-paper tables for the README (``python scripts/simulate_vs_paper.py``).

The paper's numbers come from ``tests/planner/paper_tables.py``, the same data the tests check.
"""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from simulate import max_seq_len, plan  # noqa: E402
from tests.planner.paper_tables import (  # noqa: E402
    MEMORY_TOLERANCE,
    PROTOTYPE,
    TABLE2,
    TABLE3,
    TABLE4,
    THROUGHPUT_TOLERANCE,
)

SHORT = {"llama3.2-1b": "1B", "llama3.1-8b": "8B"}


class Tally:
    """Counts checks within tolerance, and apart from them the values the throughput constants were fitted to."""

    def __init__(self) -> None:
        self.passed = self.total = self.fitted = 0

    def check(self, ok: bool) -> str:
        self.total += 1
        self.passed += ok
        return "" if ok else " ✗"

    def fit(self) -> str:
        """A value `simulate/calibration.py` was fitted to: shown, but it checks nothing."""
        self.fitted += 1
        return " (fitted)"


def _k(tps: float | None) -> str:
    return "-" if tps is None else f"{tps / 1e3:.2f}k"


def _err(pred: float, ref: float, tol: float, tally: Tally, fitted: bool = False) -> str:
    rel = pred / ref - 1
    return f"{rel:+.1%}{tally.fit() if fitted else tally.check(abs(rel) <= tol)}"


def table2(tally: Tally) -> list[str]:
    lines = ["| model | GPUs | MBS 1 | MBS 2 | MBS 4 | MBS 8 |", "|---|---|---|---|---|---|"]
    groups: dict[tuple[str, object], list[str]] = {}
    for row in TABLE2:
        best = max_seq_len(**PROTOTYPE, model=row.model, gpus=row.gpus, method="zero-dp", mbs=row.mbs)
        pred = best.config.seq_len if best else None
        cell = f"{row.max_seq_len or 'OOM'} / {pred or 'OOM'}{tally.check(pred == row.max_seq_len)}"
        groups.setdefault((row.model, row.gpus), []).append(cell)
    for (model, gpus), cells in groups.items():
        lines.append(f"| {SHORT[model]} | {gpus} | " + " | ".join(cells) + " |")
    return lines


def table3(tally: Tally) -> list[str]:
    lines = ["| model | MBS | T | non-DP paper / predicted | error | ZeRO-DP+ paper / predicted | error |",
             "|---|---|---|---|---|---|---|"]
    for row in TABLE3:
        cells = []
        for method, ref in (("nondp-fsdp", row.nondp_tps), ("zero-dp", row.zero_dp_tps)):
            pred = plan(**PROTOTYPE, model=row.model, gpus=4, method=method, mbs=row.mbs, seq_len=row.seq_len)
            tps = pred.tokens_per_second_per_gpu
            fitted = method == "nondp-fsdp"  # Table 3's non-private rows calibrate the throughput model
            cells += [f"{_k(ref)} / {_k(tps)}", _err(tps, ref, THROUGHPUT_TOLERANCE, tally, fitted)]
        lines.append(f"| {SHORT[row.model]} | {row.mbs} | {row.seq_len} | " + " | ".join(cells) + " |")
    return lines


def table4(tally: Tally) -> list[str]:
    lines = ["| model | MBS | T | method | paper GiB / predicted | error | paper TPS / predicted | error |",
             "|---|---|---|---|---|---|---|---|"]
    for row in TABLE4:
        reported = {"nondp-cp": (row.nondp_gib, row.nondp_tps), "zero-dp": (None, None),
                    "v1": (row.v1_gib, row.v1_tps), "v2": (row.v2_gib, row.v2_tps)}
        for method, (gib, tps) in reported.items():
            p = plan(**PROTOTYPE, model=row.model, gpus=4, method=method, mbs=row.mbs, seq_len=row.seq_len)
            head = f"| {SHORT[row.model]} | {row.mbs} | {row.seq_len} | {method} |"
            if gib is None:
                verdict = "OOM / " + ("OOM" if not p.fits else f"fits ({p.peak_memory_gib:.1f})")
                lines.append(f"{head} {verdict}{tally.check(not p.fits)} | | | |")
                continue
            mem = f"{gib:.1f} / {p.peak_memory_gib:.1f}{'' if p.fits else ' (OOM)'}"
            tally.check(p.fits)
            fitted = method == "nondp-cp"  # so do Table 4's non-private throughputs (its memory was not fitted)
            speed = _err(p.tokens_per_second_per_gpu, tps, THROUGHPUT_TOLERANCE, tally, fitted)
            lines.append(f"{head} {mem} | {_err(p.peak_memory_gib, gib, MEMORY_TOLERANCE, tally)} | "
                         f"{_k(tps)} / {_k(p.tokens_per_second_per_gpu)} | {speed} |")
    return lines


def main() -> None:
    tally = Tally()
    parts = [
        "**Table 2** (ZeRO-DP+ max power-of-two T, H100 80GB; paper / predicted):", "", *table2(tally), "",
        "**Table 3** (tokens/s/GPU on 4x H100 at Table 2's max T; tolerance 20%):", "", *table3(tally), "",
        "**Table 4** (CP = 4 on 4x H100; peak reserved GiB within 10%, tokens/s/GPU within 20%):", "",
        *table4(tally), "",
    ]
    print("\n".join(parts))
    print(f"{tally.total} checked, {tally.fitted} fitted: {tally.passed} of {tally.total} checks within tolerance "
          "(✗ marks the others; (fitted) marks the non-private throughputs the constants in `simulate/calibration.py` "
          "were fitted to, shown but not counted).")


if __name__ == "__main__":
    main()
