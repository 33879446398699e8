"""The analytic model against the LongShield paper's Tables 2, 3 and 4 (see ``paper_tables.py``).

Every maximum sequence length and fit/OOM verdict must match; peak memory within 10 %, throughput within 20 %.
The few rows the first-principles model cannot reproduce are strict xfails with the reason, so they are visible
and flip to failures if the model starts matching them.
"""

from __future__ import annotations

import pytest

from simulate import max_seq_len, plan
from simulate.memory import uses_ghost_norm
from tests.planner.paper_tables import (
    EIGHT_B,
    MEMORY_TOLERANCE,
    ONE_B,
    PROTOTYPE,
    TABLE2,
    TABLE3,
    TABLE4,
    THROUGHPUT_TOLERANCE,
    CpRow,
    FsdpThroughputRow,
    MaxSeqRow,
)

_ZERO_DP_8B_SHORT_T = (
    "ZeRO-DP+ 8B at T <= 2k: the paper measures 1.8-2.6x slowdowns that it attributes to unoptimised DP "
    "communication and ineffective batching in its Opacus-based prototype; counted ghost-norm Gram FLOPs, "
    "grad-sample einsums and reduce-scatter predict 1.1-1.4x"
)
_V2_8B_MBS4 = (
    "V2 8B MBS 4: the paper's 2.27x gap is an outlier it calls exposed communication in an ill-formed CP setting; "
    "the 48 GB per-rank reduce-scatter per microbatch is hidden behind backward at NVLink bandwidth in the model"
)
_KNOWN_THROUGHPUT_MISSES = {
    ("zero-dp", EIGHT_B, 2): _ZERO_DP_8B_SHORT_T,
    ("zero-dp", EIGHT_B, 4): _ZERO_DP_8B_SHORT_T,
    ("zero-dp", EIGHT_B, 8): _ZERO_DP_8B_SHORT_T,
    ("v2", EIGHT_B, 4): _V2_8B_MBS4,
}


def _known_miss(method: str, model: str, mbs: int) -> list[pytest.MarkDecorator]:
    reason = _KNOWN_THROUGHPUT_MISSES.get((method, model, mbs))
    return [pytest.mark.xfail(strict=True, reason=reason)] if reason else []


def _within(predicted: float, reported: float, tolerance: float) -> None:
    assert abs(predicted / reported - 1) <= tolerance, f"predicted {predicted:.4g} vs paper {reported:.4g}"


# --- Table 2: ZeRO-DP+ maximum sequence length --------------------------------------------------------------

@pytest.mark.parametrize("row", [pytest.param(r, id=f"{r.model}-{r.gpus}gpu-mbs{r.mbs}") for r in TABLE2])
def test_table2_zero_dp_max_seq_len(row: MaxSeqRow) -> None:
    best = max_seq_len(**PROTOTYPE, model=row.model, gpus=row.gpus, method="zero-dp", mbs=row.mbs)
    assert (best.config.seq_len if best else None) == row.max_seq_len


# --- Table 3: non-DP FSDP and ZeRO-DP+ throughput at Table 2's maximum T ------------------------------------

def _table3(method: str) -> list:
    return [pytest.param(r, id=f"{r.model}-mbs{r.mbs}-T{r.seq_len}", marks=_known_miss(method, r.model, r.mbs))
            for r in TABLE3]


@pytest.mark.parametrize("row", _table3("nondp-fsdp"))
def test_table3_nondp_fsdp_throughput(row: FsdpThroughputRow) -> None:
    p = plan(**PROTOTYPE, model=row.model, gpus=4, method="nondp-fsdp", mbs=row.mbs, seq_len=row.seq_len)
    assert p.fits
    _within(p.tokens_per_second_per_gpu, row.nondp_tps, THROUGHPUT_TOLERANCE)


@pytest.mark.parametrize("row", _table3("zero-dp"))
def test_table3_zero_dp_throughput(row: FsdpThroughputRow) -> None:
    p = plan(**PROTOTYPE, model=row.model, gpus=4, method="zero-dp", mbs=row.mbs, seq_len=row.seq_len)
    assert p.fits
    _within(p.tokens_per_second_per_gpu, row.zero_dp_tps, THROUGHPUT_TOLERANCE)


# --- Table 4: CP = 4 verdicts, peak memory and throughput ---------------------------------------------------

def _cp_id(row: CpRow) -> str:
    return f"{row.model}-mbs{row.mbs}-T{row.seq_len}"


def _reported(row: CpRow, method: str) -> tuple[float | None, float | None]:
    """(tokens/s, GiB) the paper reports for a method; (None, None) for OOM."""
    return {"nondp-cp": (row.nondp_tps, row.nondp_gib), "v1": (row.v1_tps, row.v1_gib),
            "v2": (row.v2_tps, row.v2_gib), "zero-dp": (None, None)}[method]


_CP_METHODS = ("nondp-cp", "zero-dp", "v1", "v2")
_VERDICTS = [pytest.param(r, m, id=f"{m}-{_cp_id(r)}") for r in TABLE4 for m in _CP_METHODS]
_MEASURED = [(r, m) for r in TABLE4 for m in ("nondp-cp", "v1", "v2") if _reported(r, m)[0] is not None]


@pytest.mark.parametrize(("row", "method"), _VERDICTS)
def test_table4_fit_verdict(row: CpRow, method: str) -> None:
    p = plan(**PROTOTYPE, model=row.model, gpus=4, method=method, mbs=row.mbs, seq_len=row.seq_len)
    assert p.fits == (_reported(row, method)[1] is not None)


@pytest.mark.parametrize(("row", "method"), [pytest.param(r, m, id=f"{m}-{_cp_id(r)}") for r, m in _MEASURED])
def test_table4_peak_memory(row: CpRow, method: str) -> None:
    p = plan(**PROTOTYPE, model=row.model, gpus=4, method=method, mbs=row.mbs, seq_len=row.seq_len)
    _within(p.peak_memory_gib, _reported(row, method)[1], MEMORY_TOLERANCE)


@pytest.mark.parametrize(("row", "method"), [pytest.param(r, m, id=f"{m}-{_cp_id(r)}",
                                                          marks=_known_miss(m, r.model, r.mbs))
                                             for r, m in _MEASURED])
def test_table4_throughput(row: CpRow, method: str) -> None:
    p = plan(**PROTOTYPE, model=row.model, gpus=4, method=method, mbs=row.mbs, seq_len=row.seq_len)
    _within(p.tokens_per_second_per_gpu, _reported(row, method)[0], THROUGHPUT_TOLERANCE)


@pytest.mark.parametrize(("row", "method"), [pytest.param(r, m, id=f"{m}-{_cp_id(r)}") for r, m in _MEASURED])
def test_table4_rows_are_the_maximum_seq_len(row: CpRow, method: str) -> None:
    """Table 4 reports each run 'at the maximum sequence length reached': doubling T must not fit."""
    best = max_seq_len(**PROTOTYPE, model=row.model, gpus=4, method=method, mbs=row.mbs)
    assert best is not None and best.config.seq_len == row.seq_len


# --- claims in the text ----------------------------------------------------------------------------------------

def test_mixed_ghost_norm_picks_ghost_for_the_8b_head_below_16k() -> None:
    head = 128256 * 4096
    assert uses_ghost_norm(8192, head) and not uses_ghost_norm(32768, head)


@pytest.mark.parametrize("model", [ONE_B, EIGHT_B])
def test_longshield_scales_context_4x_over_zero_dp_on_4_gpus(model: str) -> None:
    zero_dp = max_seq_len(**PROTOTYPE, model=model, gpus=4, method="zero-dp", mbs=1).config.seq_len
    assert max_seq_len(**PROTOTYPE, model=model, gpus=4, method="v2", mbs=1).config.seq_len == 4 * zero_dp


@pytest.mark.parametrize("model", [ONE_B, EIGHT_B])
def test_v3_extends_v2_by_the_factor_ac_gives_non_dp(model: str) -> None:
    def longest(method: str) -> int:
        return max_seq_len(**PROTOTYPE, model=model, gpus=4, method=method, mbs=1).config.seq_len

    assert longest("v3") / longest("v2") == longest("nondp-cp-ac") / longest("nondp-cp") > 1


def test_activation_checkpointing_costs_about_a_third_of_throughput() -> None:
    def tps(method: str) -> float:
        return plan(**PROTOTYPE, model=EIGHT_B, gpus=4, method=method, mbs=1, seq_len=16384).tokens_per_second_per_gpu

    assert 0.6 <= tps("nondp-cp-ac") / tps("nondp-cp") <= 0.8
