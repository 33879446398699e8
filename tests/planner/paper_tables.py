"""Published numbers from ``../shared/seeds/longshield-paper.md`` (4.1: one node of 4x H100 80GB, NVLink,
TorchTitan + FSDP2 bf16 mixed precision, AdamW). Memory columns are TorchTitan's peak *reserved* memory, which
it prints in GiB (the paper labels them GB). ``None`` marks OOM. Transcribed, not derived.
"""

from __future__ import annotations

from dataclasses import dataclass

ONE_B, EIGHT_B = "llama3.2-1b", "llama3.1-8b"


@dataclass(frozen=True)
class MaxSeqRow:
    """Table 2: largest power-of-two T that ZeRO-DP+ (FSDP) reaches."""

    model: str
    gpus: int | str
    mbs: int
    max_seq_len: int | None


@dataclass(frozen=True)
class FsdpThroughputRow:
    """Table 3: tokens/s/GPU of non-DP FSDP and ZeRO-DP+ at Table 2's maximum T on 4 GPUs."""

    model: str
    mbs: int
    seq_len: int
    nondp_tps: float
    zero_dp_tps: float


@dataclass(frozen=True)
class CpRow:
    """Table 4: CP = 4 on 4 GPUs at the maximum T LongShield reaches; ZeRO-DP+ is OOM in every row."""

    model: str
    mbs: int
    seq_len: int
    nondp_tps: float
    v1_tps: float | None
    v2_tps: float
    nondp_gib: float
    v1_gib: float | None
    v2_gib: float


_TABLE2 = {  # (model, gpus) -> max T for MBS 1, 2, 4, 8
    (ONE_B, 1): (16384, 8192, 4096, 2048),
    (ONE_B, 4): (16384, 8192, 4096, 2048),
    (ONE_B, "inf"): (16384, 8192, 4096, 2048),
    (EIGHT_B, 1): (None, None, None, None),
    (EIGHT_B, 4): (4096, 2048, 1024, 512),
    (EIGHT_B, "inf"): (4096, 2048, 1024, 512),
}
TABLE2 = [
    MaxSeqRow(model, gpus, mbs, t)
    for (model, gpus), lengths in _TABLE2.items()
    for mbs, t in zip((1, 2, 4, 8), lengths)
]

TABLE3 = [
    FsdpThroughputRow(ONE_B, 1, 16384, 28.8e3, 25.0e3),
    FsdpThroughputRow(ONE_B, 2, 8192, 35.7e3, 24.2e3),
    FsdpThroughputRow(ONE_B, 4, 4096, 40.8e3, 29.1e3),
    FsdpThroughputRow(ONE_B, 8, 2048, 44.1e3, 22.6e3),
    FsdpThroughputRow(EIGHT_B, 1, 4096, 7.18e3, 4.30e3),
    FsdpThroughputRow(EIGHT_B, 2, 2048, 7.64e3, 2.98e3),
    FsdpThroughputRow(EIGHT_B, 4, 1024, 7.79e3, 3.90e3),
    FsdpThroughputRow(EIGHT_B, 8, 512, 7.91e3, 4.47e3),
]

TABLE4 = [
    CpRow(ONE_B, 1, 65536, 11.8e3, 11.4e3, 11.6e3, 69.0, 70.6, 66.2),
    CpRow(ONE_B, 2, 32768, 16.4e3, 15.1e3, 15.8e3, 68.4, 70.5, 66.7),
    CpRow(ONE_B, 4, 16384, 20.9e3, 18.1e3, 19.4e3, 68.0, 71.2, 66.4),
    CpRow(EIGHT_B, 1, 16384, 4.44e3, None, 4.08e3, 73.2, None, 72.2),
    CpRow(EIGHT_B, 2, 8192, 4.82e3, None, 4.09e3, 73.3, None, 76.4),
    CpRow(EIGHT_B, 4, 4096, 4.99e3, None, 2.20e3, 73.3, None, 76.6),
]

# The planner's inputs as the paper's prototype ran: it computes the loss over the whole logits.
PROTOTYPE = dict(loss_chunk_tokens=None)
MEMORY_TOLERANCE = 0.10
THROUGHPUT_TOLERANCE = 0.20
