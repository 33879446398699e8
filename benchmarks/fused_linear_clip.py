"""Per-layer clipping of linear weights, layer by layer: the fused kernels, for each ``--tiles``, against the PyTorch
path and non-DP's weight gradient, for every distinct projection of a Llama preset. Prints JSON.

Each projection's output gradients ``G`` and inputs ``A`` (``MBS x T`` tokens, ``--dtype``) go through:

- ``nondp``: non-DP's weight gradient, one matrix product ``G^T A``;
- ``torch_path``: `PerLayerClipping(kernel="torch")`'s work: the per-sample gradients by one batched product
  (`token_outer_products`), then `PerLayerClipper.clip` (blocked norms, clip factors, the clipped sum);
- ``fused``: `PerLayerClipper.clip_linear` with each `FusedTiles` (``OUTxTOKENSxWARPSxSTAGES``): the two Triton
  kernels (CUDA and Triton only).

Times are milliseconds per call (the best of ``--repeats`` on CPU, Triton's ``do_bench`` median on CUDA); ``model``
sums them over every block's projections (``n_layers`` x 7) and gives each fused tile's time over the PyTorch path's.
The fused kernels' rounding is the same for every tile (their tests); this picks the fastest.

    python benchmarks/fused_linear_clip.py                                          # llama3.2-1b, T 4096, MBS 2
    python benchmarks/fused_linear_clip.py --tiles 64x32x4x3 128x32x8x3 128x64x8x3 256x32x8x3
    python benchmarks/fused_linear_clip.py --device cpu --preset tiny --seq-len 256 --dtype fp32  # no fused
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any, Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from noise_generation import best_of  # noqa: E402

from lightning_longshield.privacy.accumulator import ClippedGradientSum  # noqa: E402
from lightning_longshield.privacy.grad_sample.exchange import LocalExchange  # noqa: E402
from lightning_longshield.privacy.grad_sample.layers import token_outer_products  # noqa: E402
from lightning_longshield.privacy.per_layer import PerLayerClipper  # noqa: E402
from lightning_longshield.privacy.triton_support import triton_runs_on  # noqa: E402
from simulate.specs import get_model_spec  # noqa: E402

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
SWEPT_TILES = ("64x32x4x3", "128x32x8x3", "128x64x8x3", "64x64x4x4", "256x32x8x3")


def _tiles(text: str) -> tuple[int, int, int, int]:
    try:
        block_out, block_tokens, num_warps, num_stages = (int(part) for part in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not OUTxTOKENSxWARPSxSTAGES, e.g. 64x32x4x3") from None
    return block_out, block_tokens, num_warps, num_stages


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    parser.add_argument("--preset", default="llama3.2-1b", help="model preset whose projections are timed")
    parser.add_argument("--seq-len", type=int, default=4096)
    parser.add_argument("--micro-batch-size", type=int, default=2)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bf16", help="inputs and output gradients")
    parser.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    parser.add_argument("--tiles", type=_tiles, nargs="+", default=[_tiles(t) for t in SWEPT_TILES],
                        help="fused tiles to time, OUTxTOKENSxWARPSxSTAGES")
    parser.add_argument("--repeats", type=int, default=5, help="timed calls on CPU")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("CUDA is not available; use --device cpu (the fused kernels are then not timed).")
    if min(args.seq_len, args.micro_batch_size, args.repeats) < 1:
        parser.error("--seq-len, --micro-batch-size and --repeats must be >= 1")
    return args


def _milliseconds(call: Callable[[], Any], device: torch.device, repeats: int) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return round(float(do_bench(call, return_mode="median")), 4)
    call()  # warm-up
    return round(best_of(repeats, call, device) * 1e3, 4)


def time_projection(in_features: int, out_features: int, args: argparse.Namespace,
                    tiles: list[Any]) -> dict[str, Any]:
    """Milliseconds per call of each path for one ``in_features -> out_features`` projection."""
    device, dtype = torch.device(args.device), DTYPES[args.dtype]
    batch = args.micro_batch_size
    activation = torch.randn(batch, args.seq_len, in_features, device=device, dtype=dtype)
    grad_output = torch.randn(batch, args.seq_len, out_features, device=device, dtype=dtype) / args.seq_len
    weight = torch.nn.Parameter(torch.zeros(out_features, in_features, device=device))
    clipper = PerLayerClipper({"weight": 1.0}, ClippedGradientSum({"weight": weight}), LocalExchange())
    clipper.start_microbatch(batch, device)
    tokens_a, tokens_g = activation.reshape(-1, in_features), grad_output.reshape(-1, out_features)
    row: dict[str, Any] = {
        "in_features": in_features, "out_features": out_features,
        "nondp_ms": _milliseconds(lambda: tokens_g.t() @ tokens_a, device, args.repeats),
        "torch_path_ms": _milliseconds(
            lambda: clipper.clip({"weight": token_outer_products(grad_output, activation)}), device, args.repeats),
    }
    row["fused_ms"] = {name: _milliseconds(lambda t=t: clipper.clip_linear("weight", activation, grad_output, t),
                                           device, args.repeats) for name, t in tiles}
    return row


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    fused = triton_runs_on(torch.device(args.device))
    tiles = []
    if fused:
        from lightning_longshield.privacy.fused_linear_clip import FusedTiles

        tiles = [("x".join(map(str, t)), FusedTiles(*t)) for t in args.tiles]
    spec = get_model_spec(args.preset)
    shapes = sorted({(lin.in_features, lin.out_features) for lin in spec.block_linears()})
    counts = {shape: sum((lin.in_features, lin.out_features) == shape for lin in spec.block_linears()) * spec.n_layers
              for shape in shapes}
    rows = [time_projection(n_in, n_out, args, tiles) for n_in, n_out in shapes]

    def total(get: Callable[[dict[str, Any]], float]) -> float:
        return round(sum(get(row) * counts[row["in_features"], row["out_features"]] for row in rows), 3)

    model: dict[str, Any] = {"nondp_ms": total(lambda r: r["nondp_ms"]),
                             "torch_path_ms": total(lambda r: r["torch_path_ms"])}
    if tiles:
        model["fused_ms"] = {name: total(lambda r, n=name: r["fused_ms"][n]) for name, _ in tiles}
        model["fused_over_torch_path"] = {name: round(ms / model["torch_path_ms"], 3)
                                          for name, ms in model["fused_ms"].items()}
        model["fastest_tiles"] = min(model["fused_ms"], key=model["fused_ms"].get)
    config = {"preset": args.preset, "seq_len": args.seq_len, "micro_batch_size": args.micro_batch_size,
              "dtype": args.dtype, "device": args.device, "fused_kernels": fused,
              "gpu": torch.cuda.get_device_name() if args.device == "cuda" else None, "torch": torch.__version__}
    print(json.dumps({"config": config, "projections": rows, "model": model}, indent=2))


if __name__ == "__main__":
    main()
