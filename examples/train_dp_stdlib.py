"""Differentially private language-model training on the Python standard library's source, byte by byte.

Trains the ``tiny`` Llama preset (byte vocabulary, ~3.3M parameters) with DP-SGD through `LongShieldStrategy`:
each window of ``--seq-len`` + 1 bytes (inputs and the shifted label) is one privacy unit, logical batches are
Poisson-sampled with expected size ``--batch-size``, and the noise is calibrated so that ``--max-steps`` steps
spend at most ``--target-epsilon``.
The last 5% of the windows are held out; the script ends by printing the privacy guarantee, what it covers, and
the validation perplexity. The noise and the Poisson sampling come from OS entropy (``--seed`` fixes only the
model's initialisation); nothing computed from the training batches is logged. The defaults take a few
minutes on an idle 2-core CPU and reach a validation perplexity of about 21 to 27 (a uniform guess over bytes is 256):

    python examples/train_dp_stdlib.py
    python examples/train_dp_stdlib.py --seq-len 256 --batch-size 32 --max-steps 100 --target-epsilon 3
"""

from __future__ import annotations

import argparse
import math
import warnings
from typing import Optional

import lightning as L

from lightning_longshield import CausalLMModule, LongShieldStrategy
from lightning_longshield.models import LlamaConfig
from lightning_longshield.progress import StepProgressBar
from lightning_longshield.text_data import StdlibTextDataModule


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq-len", type=int, default=1024, help="bytes per sample (the privacy unit)")
    parser.add_argument("--batch-size", type=int, default=8, help="expected logical (privacy) batch size")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="samples per forward/backward (memory)")
    parser.add_argument("--max-steps", type=int, default=24, help="DP steps (optimizer steps)")
    parser.add_argument("--target-epsilon", type=float, default=8.0, help="privacy budget of the whole run")
    parser.add_argument("--max-grad-norm", type=float, default=1.0, help="per-sample clipping bound C")
    parser.add_argument("--clipping", choices=("flat", "per_layer"), default="flat",
                        help="one norm per sample, or each layer to its own share of C (per_layer)")
    parser.add_argument("--norms", choices=("materialize", "ghost", "mixed", "hutchinson", "hutchpp"),
                        default="materialize",
                        help="per-sample gradients, ghost norms with book-keeping (mixed: the cheaper per weight), or"
                             " randomized clipping with 32 projections (its own accountant calibrates the noise)")
    parser.add_argument("--learning-rate", type=float, default=1e-2, help="AdamW learning rate")
    parser.add_argument("--max-bytes", type=int, default=2_000_000, help="bytes of standard-library source to use")
    parser.add_argument("--precision", default="32-true", help="Lightning precision, e.g. 32-true or bf16-mixed")
    parser.add_argument("--seed", type=int, default=0, help="model initialisation only (never the noise or sampling)")
    parser.add_argument(
        "--secure-mode", action="store_true",
        help="noise from ChaCha20 with hardened Gaussians (the sampling is cryptographic either way)",
    )
    parser.add_argument(
        "--val-check-interval", type=int, default=0, help="also validate every N steps (0: only after training)"
    )
    return parser.parse_args(argv)


def main(argv: Optional[list[str]] = None) -> None:
    args = parse_args(argv)
    data = StdlibTextDataModule(
        seq_len=args.seq_len, batch_size=args.batch_size, max_bytes=args.max_bytes, val_batch_size=args.micro_batch_size
    )
    data.setup()
    module = CausalLMModule(LlamaConfig.from_name("tiny"), optimizer="adamw", learning_rate=args.learning_rate)
    strategy = LongShieldStrategy(
        target_epsilon=args.target_epsilon,
        max_grad_norm=args.max_grad_norm,
        micro_batch_size=args.micro_batch_size,
        clipping=args.clipping,
        norms=args.norms,
        seed=args.seed,
        secure_mode=args.secure_mode,
    )
    validation = (
        {"val_check_interval": args.val_check_interval, "check_val_every_n_epoch": None}
        if args.val_check_interval > 0
        else {}
    )
    train_loader = data.train_dataloader()
    trainer = L.Trainer(
        strategy=strategy,
        accelerator="cpu",
        devices=1,
        precision=args.precision,
        max_steps=args.max_steps,
        callbacks=[StepProgressBar()],  # steps of the run (an epoch is no unit of Poisson-sampled training)
        logger=False,
        enable_checkpointing=False,
        num_sanity_val_steps=0,
        log_every_n_steps=5,
        **validation,
    )
    # Lightning 2.6's own use of a torch API deprecated in torch 2.13; nothing this script can change.
    warnings.filterwarnings("ignore", ".*isinstance\\(treespec, LeafSpec\\).*")
    if not validation:  # validation runs once, after training
        warnings.filterwarnings("ignore", ".*but have no `val_dataloader`.*")
    trainer.fit(
        module,
        train_dataloaders=train_loader,
        val_dataloaders=data.val_dataloader() if validation else None,
    )
    (metrics,) = trainer.validate(module, dataloaders=data.val_dataloader(), verbose=False)

    print(strategy.privacy.describe_guarantee(data.describe_privacy_unit()))
    print(
        f"Released: the noisy parameters after each of the {trainer.global_step} steps, epsilon, and validation"
        " metrics on held-out windows. Not released: training losses, per-sample gradients or norms, the noise and"
        " sampling randomness (drawn from OS entropy, stored nowhere)."
    )
    print(
        f"Validation perplexity: {metrics['val_perplexity']:.2f} (loss {metrics['val_loss']:.3f} nats/byte,"
        f" {metrics['val_loss'] / math.log(2):.3f} bits/byte) on {len(data.val_dataset)} held-out windows"
    )


if __name__ == "__main__":
    main()
