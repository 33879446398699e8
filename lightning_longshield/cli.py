"""``longshield-train``: DP training and fine-tuning from a YAML file and flags (LightningCLI).

    longshield-train fit --config examples/configs/finetune_lora.yaml
    longshield-train fit --config run.yaml --model.lora.rank 16 --trainer.max_steps 100
    longshield-train fit --config run.yaml --print_config

``model`` is `CausalLMModule` (a preset name or a local Hugging Face directory as ``config``, optional ``lora``),
``data`` any data module by ``class_path`` (`LocalTextDataModule` for local files, `StdlibTextDataModule`), and
``trainer.strategy`` defaults to `LongShieldStrategy`, whose arguments go under its ``init_args``. After ``fit``
the privacy guarantee is printed with the data's privacy unit; ``--export_to DIR`` then writes the trained model
(LoRA merged) as a Hugging Face directory. The training progress bar counts steps (`StepProgressBar`).
"""

from __future__ import annotations

from typing import Any, Optional

from lightning.pytorch import Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningCLI

from lightning_longshield.hf import require_hf
from lightning_longshield.module import CausalLMModule
from lightning_longshield.progress import StepProgressBar

DEFAULT_STRATEGY = {"class_path": "lightning_longshield.LongShieldStrategy"}


class LongShieldCLI(LightningCLI):
    """LightningCLI with `LongShieldStrategy` as the default strategy, a step progress bar, the guarantee printed
    after ``fit`` and an optional Hugging Face export."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--export_to", type=Optional[str], default=None,
                            help="after fit, write the model (LoRA merged) here as a Hugging Face directory")

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        chosen = [*callbacks, *(config.get("callbacks") or [])]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in chosen):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def after_fit(self) -> None:
        strategy = self.trainer.strategy
        privacy = getattr(strategy, "privacy", None)
        if privacy is not None and privacy.plan is not None and self.trainer.is_global_zero:
            describe_unit = getattr(self.datamodule, "describe_privacy_unit", None)
            unit = describe_unit() if callable(describe_unit) else "one training sample"
            print(privacy.describe_guarantee(unit))
        export_to = self.config.get(self.subcommand, {}).get("export_to")
        if export_to:
            self.model.save_pretrained(export_to)
            if self.trainer.is_global_zero:
                print(f"Exported the trained model to {export_to}")


def run_cli(args: Optional[list[str]] = None, run: bool = True) -> LongShieldCLI:
    """Run ``longshield-train`` with ``args`` (default: the command line) and return the CLI (its ``trainer``,
    ``model`` and ``datamodule``); ``run=False`` only builds them from ``args`` (no subcommand)."""
    require_hf("jsonargparse")
    return LongShieldCLI(
        CausalLMModule,
        subclass_mode_data=True,
        trainer_defaults={"strategy": DEFAULT_STRATEGY},
        save_config_kwargs={"overwrite": True},
        args=args,
        run=run,
    )


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``longshield-train`` console script. Returns None, so that the process exits with status
    0 after a successful run (`run_cli` returns the CLI object)."""
    run_cli(args)


if __name__ == "__main__":
    main()
