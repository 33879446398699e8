"""Context-parallel attention of one rank, forward + backward, against a 1/CP share of full causal attention.

Emulates CP rank 0 of ``--cp`` on one device (it holds the first and the last chunk, the two ends of the causal
work): the gathered K/V are given directly, so this times the attention compute, not the all-gather. Compared:

- ``prefix``: what `ContextParallelAttention` runs (`head_tail_attention`): K/V with their ``n_kv_heads`` heads,
  repeated after the gather, one call per local chunk over its key prefix (`prefix_causal_attention`: SDPA with a
  lower-right causal bias on CUDA, two flash calls merged by log-sum-exp on CPU);
- ``masked``: the previous implementation, one SDPA call with an additive ``(T_local, T)`` position mask;
- ``flash_share``: full causal SDPA over the whole sequence (``is_causal``), divided by CP.

Prints one JSON object with milliseconds, peak memory (CUDA) and the ratios ``prefix / flash_share`` and
``masked / flash_share``. The issue's sizes need a GPU:

    python benchmarks/cp_attention.py                                # CUDA: T 65536 and 131072, CP 4, bf16
    python benchmarks/cp_attention.py --device cpu --seq-lens 1024   # a CPU smoke run
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from lightning_longshield.context_parallel.attention import head_tail_attention
from lightning_longshield.context_parallel.sharding import shard_sequence


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[65536, 131072])
    parser.add_argument("--cp", type=int, default=4)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--head-dim", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--skip-masked", action="store_true", help="skip the masked baseline (it needs T_local x T)")
    return parser.parse_args()


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(run: Callable[[], torch.Tensor], device: torch.device, repeats: int) -> dict[str, float]:
    """Median milliseconds of forward + backward, and the peak allocated GiB on CUDA."""
    run().sum().backward()  # warm-up
    times = []
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        run().sum().backward()
        synchronize(device)
        times.append(1000 * (time.perf_counter() - start))
    peak = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    return {"ms": round(statistics.median(times), 3), "peak_gib": None if peak is None else round(peak, 3)}


def one_length(args: argparse.Namespace, seq_len: int, device: torch.device) -> dict[str, object]:
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = (1, args.heads, seq_len, args.head_dim)
    kv_shape = (1, args.kv_heads, seq_len, args.head_dim)
    q_full = torch.randn(shape, device=device, dtype=dtype)
    keys = torch.randn(kv_shape, device=device, dtype=dtype, requires_grad=True)
    values = torch.randn(kv_shape, device=device, dtype=dtype, requires_grad=True)
    q_local = shard_sequence(q_full, 0, args.cp, dim=2).detach().requires_grad_()
    repeats = args.heads // args.kv_heads

    def prefix() -> torch.Tensor:
        return head_tail_attention(q_local, keys, values, 0, args.cp)

    def masked() -> torch.Tensor:
        positions = shard_sequence(torch.arange(seq_len, device=device), 0, args.cp, dim=0)
        allowed = positions[:, None] >= torch.arange(seq_len, device=device)[None, :]
        mask = torch.zeros(allowed.shape, dtype=dtype, device=device).masked_fill_(~allowed, float("-inf"))
        return F.scaled_dot_product_attention(
            q_local, keys.repeat_interleave(repeats, 1), values.repeat_interleave(repeats, 1), attn_mask=mask
        )

    q_whole = q_full.detach().requires_grad_()

    def full() -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q_whole, keys.repeat_interleave(repeats, 1), values.repeat_interleave(repeats, 1), is_causal=True
        )

    result: dict[str, object] = {"seq_len": seq_len, "cp": args.cp, "dtype": str(dtype)}
    result["prefix"] = measure(prefix, device, args.repeats)
    whole = measure(full, device, args.repeats)
    share = round(whole["ms"] / args.cp, 3)
    result["flash_share"] = {"ms": share, "full_ms": whole["ms"], "peak_gib": whole["peak_gib"]}
    result["prefix_over_flash_share"] = round(result["prefix"]["ms"] / result["flash_share"]["ms"], 3)
    if not args.skip_masked:
        result["masked"] = measure(masked, device, args.repeats)
        result["masked_over_flash_share"] = round(result["masked"]["ms"] / result["flash_share"]["ms"], 3)
    return result


def main() -> None:
    args = parse_args()
    device = torch.device(args.device)
    for seq_len in args.seq_lens:
        if seq_len % (2 * args.cp):
            raise SystemExit(f"--seq-lens: {seq_len} is not divisible by 2 x cp = {2 * args.cp}.")
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}.")
    rows = [one_length(args, seq_len, device) for seq_len in args.seq_lens]
    print(json.dumps({"device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                      "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "results": rows},
                     indent=1))


if __name__ == "__main__":
    main()
