"""``longshield-train``: DP training and fine-tuning from a YAML file and flags (LightningCLI).

    longshield-train fit --config examples/configs/finetune_lora.yaml
    longshield-train fit --config run.yaml --model.lora.rank 16 --trainer.max_steps 100
    longshield-train fit --config run.yaml --print_config

``model`` is `CausalLMModule` (a preset name or a local Hugging Face directory as ``config``, optional ``lora``),
``data`` any data module by ``class_path`` (`LocalTextDataModule` for local files, `StdlibTextDataModule`), and
``trainer.strategy`` defaults to `LongShieldStrategy`, whose arguments go under its ``init_args``. After ``fit``
the privacy guarantee is printed with the data's privacy unit; ``--export_to DIR`` then writes the trained model
(LoRA merged) as a Hugging Face directory, with the model directory's tokenizer, generation defaults and special
tokens' ids, in its dtype unless ``--export_dtype`` names another.

- A data module whose ``tokenizer`` is left unset takes the model directory's tokenizer when ``model.config`` is a
  Hugging Face directory that has one; an explicit ``data.init_args.tokenizer`` wins.
- ``fit`` with a strategy other than `LongShieldStrategy` (``--trainer.strategy auto``, ``ddp``, ...) trains
  without differential privacy: it is refused unless ``--non_private true`` acknowledges it.
- The training progress bar counts steps (`StepProgressBar`).
- The merged configuration is saved as ``config.yaml`` in the logger's log directory when the run has a logger;
  with ``trainer.logger: false`` nothing is written (``--print_config`` shows it).
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Optional

import torch
from lightning.pytorch import LightningDataModule, LightningModule, Trainer
from lightning.pytorch.callbacks import Callback, ProgressBar
from lightning.pytorch.cli import LightningCLI, SaveConfigCallback
from lightning.pytorch.strategies import StrategyRegistry
from lightning.pytorch.utilities.exceptions import SIGTERMException
from lightning.pytorch.utilities.model_helpers import is_overridden
from lightning.pytorch.utilities.rank_zero import rank_zero_warn

from lightning_longshield import hf
from lightning_longshield.hf import DEFAULT_MAX_SHARD_SIZE, require_hf, shard_bytes
from lightning_longshield.local_text_data import LocalTextDataModule  # noqa: F401  (so `--data LocalTextDataModule` names it)
from lightning_longshield.module import CausalLMModule
from lightning_longshield.privacy.session import privacy_unit_of
from lightning_longshield.progress import StepProgressBar
from lightning_longshield.strategy import LongShieldStrategy

DEFAULT_STRATEGY = {"class_path": "lightning_longshield.LongShieldStrategy"}
EXPORT_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
NOT_PRIVATE = (
    "This run is NOT differentially private: trainer.strategy is not LongShieldStrategy, so no per-sample clipping,"
    " no noise and no Poisson sampling protect the training data, and no privacy guarantee is printed."
)


def is_private_strategy(strategy: Any) -> bool:
    """Whether a parsed ``trainer.strategy`` (a registry name, a class path, a ``class_path`` namespace or an
    instance) is `LongShieldStrategy` or a subclass."""
    if isinstance(strategy, LongShieldStrategy):
        return True
    chosen = strategy_class(strategy)
    return chosen is not None and issubclass(chosen, LongShieldStrategy)


def strategy_class(strategy: Any) -> Optional[type]:
    """The class that a parsed ``trainer.strategy`` names: a registry name's, a ``class_path`` namespace's, an
    importable class path's (``lightning_longshield.LongShieldStrategy``) or, by its bare name, `LongShieldStrategy`
    or a subclass of it; None for anything else."""
    if isinstance(strategy, str):
        if strategy in StrategyRegistry:
            return StrategyRegistry[strategy]["strategy"]
        class_path = strategy
    else:
        class_path = strategy.get("class_path") if hasattr(strategy, "get") else None
        if not isinstance(class_path, str):
            return None
    if "." not in class_path:
        return next((c for c in _subclasses(LongShieldStrategy) if c.__name__ == class_path), None)
    from jsonargparse.typing import import_object  # a dependency of LightningCLI

    try:
        found = import_object(class_path)
    except (ImportError, AttributeError, ValueError):
        return None
    return found if isinstance(found, type) else None


def private_registry_names() -> list[str]:
    """The names under which `LongShieldStrategy` (or a subclass) is registered (``longshield``...)."""
    return [name for name in StrategyRegistry
            if issubclass(StrategyRegistry[name]["strategy"], LongShieldStrategy)]


def _subclasses(cls: type) -> list[type]:
    """``cls`` and every subclass of it defined so far."""
    return [cls, *(sub for direct in cls.__subclasses__() for sub in _subclasses(direct))]


class SaveConfigToLogDir(SaveConfigCallback):
    """Saves the merged configuration in the logger's log directory; nothing without a logger (rather than
    ``config.yaml`` in the working directory). A strategy's ``noise_seed`` is saved as null: the run's noise and
    sampling are private only while it stays secret, and the log directory sits next to the checkpoints."""

    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        if trainer.logger is None:
            return
        strategy = self.config.get("trainer", {}).get("strategy")
        init_args = getattr(strategy, "init_args", None)
        if init_args is not None and init_args.get("noise_seed") is not None:
            self.config = self.config.clone()
            self.config.trainer.strategy.init_args.noise_seed = None
        super().setup(trainer, pl_module, stage)


class LongShieldCLI(LightningCLI):
    """LightningCLI with `LongShieldStrategy` as the default strategy (another one only with ``--non_private
    true``), the model directory's tokenizer as the data's default, a step progress bar, the guarantee printed after
    ``fit`` and an optional Hugging Face export."""

    def add_arguments_to_parser(self, parser: Any) -> None:
        parser.add_argument("--export_to", type=Optional[str], default=None,
                            help="after fit, write the model (LoRA merged) here as a Hugging Face directory, with the"
                                 " model directory's tokenizer")
        parser.add_argument("--export_dtype", type=Optional[str], default=None,
                            help=f"dtype of the exported weights, one of {list(EXPORT_DTYPES)} (default: the model"
                                 " directory's, else the parameters')")
        parser.add_argument("--export_max_shard_size", type=str, default=DEFAULT_MAX_SHARD_SIZE,
                            help="largest safetensors file of the export, e.g. 5GB or 2GiB; a larger model is written"
                                 " in several, with an index")
        parser.add_argument("--non_private", type=bool, default=False,
                            help="acknowledge that a trainer.strategy other than LongShieldStrategy trains WITHOUT"
                                 " differential privacy (no clipping, no noise, no guarantee)")

    def before_instantiate_classes(self) -> None:
        with _set_up_errors():
            self._check_configuration()

    def instantiate_classes(self) -> None:
        with _set_up_errors():
            super().instantiate_classes()

    def _check_configuration(self) -> None:
        """Refuse, before anything is built, what the run could not do (a bad export, a strategy without DP)."""
        config = self.config.get(self.subcommand, self.config) if self.subcommand else self.config
        if self.subcommand not in (None, "fit") and config.get("export_to"):
            raise ValueError(f"--export_to exports the model a fit trained; {self.subcommand} trains nothing. Export"
                             " a checkpoint with longshield-train fit --ckpt_path ... --export_to ..., or load its"
                             " state_dict and call save_pretrained (user guide, 'Checkpoints and the trained model').")
        export_dtype(config.get("export_dtype"))  # a bad name is refused before any training
        shard_bytes(config.get("export_max_shard_size", DEFAULT_MAX_SHARD_SIZE))  # as is a bad size
        check_export_destination(config.get("export_to"))  # as is a folder it could not write after training
        self._tokenizer_from_model_directory(config)
        if self.subcommand not in (None, "fit"):
            return
        strategy = config.get("trainer", {}).get("strategy")
        if is_private_strategy(strategy):
            if isinstance(strategy, str) and strategy not in StrategyRegistry:  # a class path, which Trainer refuses
                from jsonargparse import Namespace

                chosen = strategy_class(strategy)
                config.trainer.strategy = Namespace(class_path=f"{chosen.__module__}.{chosen.__qualname__}",
                                                    init_args=Namespace())
            return
        if not config.get("non_private"):
            name = strategy if isinstance(strategy, str) else getattr(strategy, "class_path", strategy)
            raise ValueError(
                f"trainer.strategy={name!r} is not LongShieldStrategy: it would train with no differential privacy"
                " (no per-sample clipping, no noise, no Poisson sampling) and ignore LongShieldStrategy's arguments."
                " Remove --trainer.strategy (LongShieldStrategy is the default) or set it to LongShieldStrategy"
                " (or lightning_longshield.LongShieldStrategy, or a subclass's class path), or to a registry name of"
                f" it ({', '.join(private_registry_names())}); to train without privacy on purpose, add"
                " --non_private true."
            )
        rank_zero_warn(NOT_PRIVATE)

    @staticmethod
    def _tokenizer_from_model_directory(config: Any) -> None:
        """Set an unset ``data.init_args.tokenizer`` to ``model.config`` when that is a Hugging Face directory with a
        tokenizer."""
        init_args = getattr(config.get("data"), "init_args", None)
        if init_args is None or "tokenizer" not in init_args or init_args.tokenizer is not None:
            return
        model_config = config.get("model", {}).get("config")
        if not isinstance(model_config, (str, os.PathLike)) or not hf.is_model_directory(model_config):
            return
        fix = "Set data.init_args.tokenizer to the model's tokenizer."
        directory = Path(model_config).expanduser()
        if hf.model_tokenizer(directory, fix) is not None:
            init_args.tokenizer = os.fspath(directory)

    def _instantiate_trainer(self, config: dict[str, Any], callbacks: list[Callback]) -> Trainer:
        chosen = [*callbacks, *(config.get("callbacks") or [])]
        if config.get("enable_progress_bar") is not False and not any(isinstance(c, ProgressBar) for c in chosen):
            callbacks = [*callbacks, StepProgressBar()]
        return super()._instantiate_trainer(config, callbacks)

    def _check_data(self, subcommand: str) -> None:
        """Refuse a subcommand whose data module (or model) has no DataLoader for it, naming what would give one
        (Lightning's error spoke of a missing method)."""
        hook = f"{_SUBCOMMAND_SPLITS[subcommand]}_dataloader"
        if any(owner is not None and is_overridden(hook, owner, base)
               for owner, base in ((self.datamodule, LightningDataModule), (self.model, LightningModule))):
            return
        if self.datamodule is None:
            raise ValueError(f"longshield-train {subcommand} needs data: pass --data (LocalTextDataModule with"
                             " --data.data_files ..., or StdlibTextDataModule), or a --config file with a data"
                             " section.")
        raise ValueError(f"longshield-train {subcommand}: {type(self.datamodule).__name__} has no {hook} (its splits"
                         " are training and validation): use fit or validate, or a data module of your own that"
                         f" defines {hook}.")

    def _run_subcommand(self, subcommand: str) -> None:
        with _set_up_errors():
            self._check_data(subcommand)
        try:
            super()._run_subcommand(subcommand)
        except SIGTERMException:  # the job's script ends cleanly (status 0), without the end of fit
            export_to = self.config.get(subcommand, {}).get("export_to")
            if export_to and self.trainer.is_global_zero:
                print(f"Stopped by SIGTERM before the end of fit: nothing was exported to {export_to}. Resume the fit"
                      " from the checkpoint named above with --export_to to export the trained model.",
                      file=sys.stderr)
            raise

    def after_fit(self) -> None:
        strategy = self.trainer.strategy
        privacy = getattr(strategy, "privacy", None)
        if privacy is not None and privacy.plan is not None and self.trainer.is_global_zero:
            print(privacy.describe_guarantee(privacy_unit_of(self.datamodule)))
        elif not isinstance(strategy, LongShieldStrategy) and self.trainer.is_global_zero:
            print(NOT_PRIVATE, file=sys.stderr)
        config = self.config.get(self.subcommand, {})
        export_to = config.get("export_to")
        if export_to:
            try:
                self.model.save_pretrained(export_to, export_dtype(config.get("export_dtype")),
                                           config.get("export_max_shard_size", DEFAULT_MAX_SHARD_SIZE),
                                           tokenizer=getattr(self.datamodule, "tokenizer", None))
            except Exception:
                self._keep_the_trained_model(export_to)
                raise
            if self.trainer.is_global_zero:
                print(f"Exported the trained model to {export_to}")

    def _keep_the_trained_model(self, export_to: str) -> None:
        """After a failed export, save the trained model as a Lightning checkpoint (no noise or sampling secret is
        in it), so that the privacy budget it spent is not lost with it; the export can be redone from it."""
        fallback = Path(self.trainer.default_root_dir) / "trained_before_failed_export.ckpt"
        try:
            self.trainer.save_checkpoint(fallback)
        except Exception as error:  # the export's own error is the one raised
            rank_zero_warn(f"Exporting to {export_to} failed, and so did saving the trained model to {fallback}:"
                           f" {error!r}.")
            return
        rank_zero_warn(f"Exporting to {export_to} failed (the error follows). The trained model was saved to"
                       f" {fallback}: export it from there without training again (its state_dict into a"
                       " CausalLMModule built with the same arguments, after configure_model(), then save_pretrained;"
                       " see the user guide, 'Checkpoints and the trained model').")


def check_export_destination(export_to: Optional[str]) -> None:
    """Refuse an ``--export_to`` that could not be written (a file, under a file, or in a folder this process may
    not write), before training spends the privacy budget; nothing is created."""
    if not export_to:
        return
    destination = Path(export_to).expanduser()
    if destination.exists() and not destination.is_dir():
        raise ValueError(f"--export_to {export_to!r} is a file, not a folder: name a folder for the export.")
    existing = destination
    while not existing.exists():
        existing = existing.parent
    if not existing.is_dir():
        raise ValueError(f"--export_to {export_to!r} lies under {str(existing)!r}, a file: name a folder for the"
                         " export.")
    if not os.access(existing, os.W_OK | os.X_OK):
        raise ValueError(f"--export_to {export_to!r}: this process may not write in {str(existing)!r}; name a folder"
                         " it can write.")


def export_dtype(name: Optional[str]) -> Optional[torch.dtype]:
    """The torch dtype of ``--export_dtype`` (None where unset); a ValueError naming the choices otherwise."""
    if name is None:
        return None
    if name not in EXPORT_DTYPES:
        raise ValueError(f"--export_dtype {name!r} is not one of {list(EXPORT_DTYPES)}.")
    return EXPORT_DTYPES[name]


def run_cli(args: Optional[list[str]] = None, run: bool = True) -> LongShieldCLI:
    """Run ``longshield-train`` with ``args`` (default: the command line) and return the CLI (its ``trainer``,
    ``model`` and ``datamodule``); ``run=False`` only builds them from ``args`` (no subcommand)."""
    require_hf("jsonargparse")
    return LongShieldCLI(
        CausalLMModule,
        subclass_mode_data=True,
        trainer_defaults={"strategy": DEFAULT_STRATEGY},
        save_config_callback=SaveConfigToLogDir,
        save_config_kwargs={"overwrite": True},
        # The model's parameters exist only after `configure_model`, and its ``optimizer`` argument builds the
        # optimizer over the trainable ones: LightningCLI's ``--optimizer`` would see none.
        auto_configure_optimizers=False,
        args=args,
        run=run,
    )


def main(args: Optional[list[str]] = None) -> None:
    """Entry point of the ``longshield-train`` console script. Returns None, so that the process exits with status
    0 after a successful run (`run_cli` returns the CLI object). An error of the configuration, found before anything
    trains, is printed as its message alone (status 2); errors during training keep their traceback."""
    try:
        run_cli(args)
    except Exception as error:
        if not getattr(error, SET_UP_ERROR, False):
            raise
        print(f"longshield-train: error: {set_up_error_message(error)}", file=sys.stderr)
        raise SystemExit(2) from None


#: The data split each subcommand reads (its DataLoader hook is ``<split>_dataloader``).
_SUBCOMMAND_SPLITS = {"fit": "train", "validate": "val", "test": "test", "predict": "predict"}

#: Marks an exception raised while the configuration was checked or its classes built (`_set_up_errors`).
SET_UP_ERROR = "_longshield_set_up_error"


@contextmanager
def _set_up_errors() -> Iterator[None]:
    try:
        yield
    except Exception as error:
        setattr(error, SET_UP_ERROR, True)
        raise


def set_up_error_message(error: BaseException) -> str:
    """What a configuration error says, without jsonargparse's dump of the parsed values (which would print a
    ``noise_seed``): a union's errors are listed, less those of its alternatives of another type (``str``, ``None``)."""
    text = str(error)
    if "Errors:" in text:
        reasons = [line.strip()[2:] for line in text.split("Errors:", 1)[1].splitlines()
                   if line.strip().startswith("- ") and not line.strip().startswith("- Expected a <class")]
        text = "; ".join(reasons) or text
    kept = [line for line in text.splitlines() if "Namespace(" not in line and not line.startswith("Given value")]
    return re.sub(r"noise_seed=\d+", "noise_seed=<hidden>", "\n".join(kept).strip())


if __name__ == "__main__":
    main()
