"""The planner's inputs from a ``longshield-train`` YAML file: the run a user is about to launch, planned as written.

The file is LightningCLI's (``model``, ``data``, ``trainer`` with ``trainer.strategy.init_args`` the strategy's own
arguments). What the planner needs: the model (``model.config``: a preset or a Hugging Face directory), its LoRA
rank, the sequence length (``data.init_args.seq_len``, else the default of the library's data module that the file
names), the GPU count (``trainer.devices`` x ``trainer.num_nodes``), the precision (Lightning's default, 32-true,
when unset or null) and the strategy's layout (`StrategyConfig.from_arguments`). A value the run would refuse is
refused here (a ValueError naming the file and the key).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from simulate.config import precision_of
from simulate.loss_chunks import LossChunking, check_loss_chunking
from simulate.specs import DEFAULT_LORA_RANK, LORA_TARGETS
from simulate.strategy_config import StrategyConfig

LIGHTNING_DEFAULT_PRECISION = "32-true"
#: `CausalLMModule`'s model when ``model.init_args.config`` is not given.
MODULE_DEFAULT_MODEL = "tiny"
#: The sequence length of the library's data modules (`LocalTextDataModule`, `StdlibTextDataModule`) when
#: ``data.init_args.seq_len`` is not given.
DATA_MODULES_DEFAULT_SEQ_LEN = {"LocalTextDataModule": 1024, "StdlibTextDataModule": 1024}
#: The forms of ``trainer.strategy`` as one string that build `LongShieldStrategy` with its defaults in
#: ``longshield-train``: its registry names, class paths and bare name.
STRATEGY_NAMES = frozenset({
    "longshield", "longshield_spawn", "LongShieldStrategy", "lightning_longshield.LongShieldStrategy",
    "lightning_longshield.strategy.LongShieldStrategy",
})
#: The library's module, whose chunked loss (``loss_chunk_tokens``) the planner models.
LIBRARY_MODULE = "CausalLMModule"
#: The parameters of the library's module and data modules, by class name (torch-free; a test keeps them in step
#: with their signatures): a run file's argument that is none of them is refused, as ``longshield-train`` refuses it,
#: rather than planned without (a misspelt ``seq_len`` planned the data module's default length).
LIBRARY_PARAMETERS: dict[str, tuple[str, ...]] = {
    LIBRARY_MODULE: ("config", "optimizer", "learning_rate", "weight_decay", "momentum", "log_train_loss", "lora",
                     "loss_chunk_tokens"),
    "LocalTextDataModule": ("data_files", "text_field", "tokenizer", "seq_len", "batch_size", "privacy_unit",
                            "val_fraction", "val_batch_size", "val_files", "cache_dir", "num_proc", "max_documents",
                            "add_eos", "seed"),
    "StdlibTextDataModule": ("seq_len", "batch_size", "val_fraction", "max_bytes", "max_files", "val_batch_size"),
}


@dataclass(frozen=True)
class PlannedRun:
    """A ``longshield-train`` file's run, as far as the file says (``None``: not in the file)."""

    model: str | None
    lora_rank: int
    seq_len: int | None
    gpus: int | None
    precision: str
    strategy: StrategyConfig
    loss_chunk_tokens: LossChunking = "auto"
    #: Where the plan of the file is approximate, to print with the result.
    notes: tuple[str, ...] = ()


def read_run_file(path: str | os.PathLike) -> PlannedRun:
    """Read ``path`` (YAML); errors (ValueError) name the file and the key."""
    try:
        import yaml
    except ImportError as err:  # PyYAML comes with Lightning; the torch-free planner may lack it
        raise ImportError("--config needs PyYAML: pip install pyyaml") from err
    with open(path, encoding="utf-8") as file:
        try:
            document = yaml.safe_load(file) or {}
        except yaml.YAMLError as err:
            raise ValueError(f"{path}: not valid YAML: {' '.join(str(err).split())}") from None
    if not isinstance(document, Mapping):
        raise ValueError(f"{path}: expected a longshield-train YAML file (model, data, trainer), not a"
                         f" {type(document).__name__}.")
    return planned_run(document, str(path))


def planned_run(document: Mapping[str, Any], source: str = "the run file") -> PlannedRun:
    """The planner's view of a parsed ``longshield-train`` document."""
    model = _init_args(document.get("model"), "model", source)
    trainer = _init_args(document.get("trainer"), "trainer", source)
    strategy = trainer.get("strategy")
    if isinstance(strategy, str):
        if strategy not in STRATEGY_NAMES:
            raise ValueError(f"{source}: trainer.strategy={strategy!r} is not LongShieldStrategy; the planner plans"
                             " DP runs of LongShieldStrategy.")
        strategy = None  # its defaults, as longshield-train builds it
    library_module = _module_name(document.get("model")) in ("", LIBRARY_MODULE)
    _check_library_arguments(LIBRARY_MODULE if library_module else "", model, "model", source)
    _check_library_arguments(_module_name(document.get("data")), _init_args(document.get("data"), "data", source),
                             "data", source)
    return PlannedRun(
        model=_model(document.get("model"), model, source),
        lora_rank=_lora_rank(model.get("lora"), source),
        seq_len=_seq_len(document.get("data"), _init_args(document.get("data"), "data", source), source),
        gpus=trainer_processes(trainer, source),
        precision=_precision(trainer.get("precision"), source),
        strategy=_strategy(_init_args(strategy, "trainer.strategy", source), source),
        loss_chunk_tokens=_loss_chunking(model.get("loss_chunk_tokens", "auto"), source) if library_module else None,
        notes=_notes(document.get("model"), model, trainer, source),
    )


def _check_library_arguments(name: str, arguments: Mapping[str, Any], key: str, source: str) -> None:
    """Refuse an argument that is no parameter of the library's class ``name`` (others are not known here), naming
    the closest one."""
    parameters = LIBRARY_PARAMETERS.get(name)
    if parameters is None:
        return
    for argument in arguments:
        if argument not in parameters:
            close = difflib.get_close_matches(str(argument), parameters, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"its parameters: {', '.join(parameters)}."
            raise ValueError(f"{source}: {key}.init_args.{argument} is no parameter of {name}; {hint}")


def _module_name(section: object) -> str:
    """The class name of the file's LightningModule (``""`` where it names none: `CausalLMModule`)."""
    return str(section.get("class_path", "")).split(".")[-1] if isinstance(section, Mapping) else ""


def _notes(section: object, model: Mapping[str, Any], trainer: Mapping[str, Any], source: str) -> tuple[str, ...]:
    """Where the planner approximates the file's run."""
    notes = []
    module = _module_name(section)
    if module not in ("", LIBRARY_MODULE):
        notes.append(f"Note: {source}'s model.class_path ({module}) is not {LIBRARY_MODULE}: planned with the whole"
                     " logits at once, as the pre-flight check plans a module of its own (not the chunked loss).")
    if str(trainer.get("precision")).startswith("bf16-true"):
        notes.append(f"Note: {source}'s trainer.precision='bf16-true' is planned as bf16-mixed (fp32 master weights,"
                     " accumulator and AdamW moments); bf16-true keeps them in bf16, so its model states are smaller.")
    lora = model.get("lora")
    targets = _init_args(lora, "model.init_args.lora", source).get("target_modules") if lora is not None else None
    if targets is not None and targets != "all-linear" and set(targets) != set(LORA_TARGETS):
        notes.append(f"Note: {source}'s model.init_args.lora.target_modules={targets!r} is not modelled: LoRA is"
                     f" planned on every block projection ({' '.join(LORA_TARGETS)}).")
    if str(trainer.get("accelerator", "")).lower() == "cpu":
        notes.append(f"Note: {source}'s trainer.accelerator='cpu': planned as on --gpu (the pre-flight check only logs"
                     " on CPU, with an H100's capacity).")
    return tuple(notes)


def _model(section: object, model: Mapping[str, Any], source: str) -> str | None:
    """``model.init_args.config`` (a preset or a Hugging Face directory), `CausalLMModule`'s own model where the
    file leaves it unset; ``None`` for another module's model (``--model``'s to say)."""
    config = model.get("config")
    if config is None:
        return MODULE_DEFAULT_MODEL if _module_name(section) in ("", LIBRARY_MODULE) else None
    if not isinstance(config, str):
        raise ValueError(f"{source}: model.init_args.config={config!r}: the planner reads a model preset name or a"
                         " Hugging Face Llama directory here.")
    return config


def _lora_rank(lora: object, source: str) -> int:
    """``model.init_args.lora.rank`` (`LoraOptions`' default where unset); 0 without LoRA (full fine-tuning)."""
    if lora is None:
        return 0
    rank = _init_args(lora, "model.init_args.lora", source).get("rank", DEFAULT_LORA_RANK)
    return _positive_int(rank, "model.init_args.lora.rank", source, optional=False)  # type: ignore[return-value]


def _precision(precision: object, source: str) -> str:
    """The planner's precision for ``trainer.precision`` (unset or null: Lightning's default, 32-true); fp16, which
    the strategy refuses, and precisions the planner does not model are refused by name."""
    precision = LIGHTNING_DEFAULT_PRECISION if precision is None else precision
    if str(precision).startswith("16"):
        raise ValueError(f"{source}: trainer.precision={precision!r}: LongShieldStrategy refuses fp16 (per-sample"
                         " gradients overflow it); use bf16-mixed, bf16-true or 32-true.")
    planned = precision_of(precision)
    if planned is None:
        raise ValueError(f"{source}: trainer.precision={precision!r} is not one the planner models; it plans"
                         " bf16-mixed, bf16-true and 32-true (or leave it unset: 32-true).")
    return planned


def _strategy(arguments: Mapping[str, Any], source: str) -> StrategyConfig:
    """The strategy's layout from its ``init_args``; an argument the strategy would refuse is named."""
    try:
        return StrategyConfig.from_arguments(arguments)
    except (TypeError, ValueError) as err:
        raise ValueError(f"{source}: trainer.strategy.init_args: {err}") from None


def _loss_chunking(value: object, source: str) -> LossChunking:
    try:
        check_loss_chunking(value)
    except ValueError as err:
        raise ValueError(f"{source}: model.init_args.{err}") from None
    return value  # type: ignore[return-value]


def _init_args(section: object, key: str, source: str) -> Mapping[str, Any]:
    """A section's arguments: ``init_args`` of a ``class_path`` section, else the section itself (``{}`` where
    absent); anything but a mapping is refused, naming ``key``."""
    if isinstance(section, Mapping) and ("class_path" in section or "init_args" in section):
        section, key = section.get("init_args"), f"{key}.init_args"
    if section is None:
        return {}
    if not isinstance(section, Mapping):
        raise ValueError(f"{source}: {key} must be a mapping of arguments (name: value), got {section!r}.")
    return section


def _seq_len(section: object, data: Mapping[str, Any], source: str) -> int | None:
    """``data.init_args.seq_len``, else the default of the library's data module the file names (another module's
    default is ``--seq-len``'s to say)."""
    if "seq_len" in data:
        return _positive_int(data["seq_len"], "data.init_args.seq_len", source)
    class_path = str(section.get("class_path", "")) if isinstance(section, Mapping) else ""
    return DATA_MODULES_DEFAULT_SEQ_LEN.get(class_path.split(".")[-1])


def _positive_int(value: object, key: str, source: str, optional: bool = True) -> int | None:
    """``value`` checked to be a positive integer (``None`` passes where ``optional``), naming ``key`` if not."""
    if value is None and optional:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{source}: {key} must be a positive integer, got {value!r}.")
    return value


def trainer_processes(trainer: Mapping[str, Any], source: str) -> int | None:
    """The run's processes, ``trainer.devices`` x ``trainer.num_nodes``, where ``devices`` is a count, a list of
    device indices or Lightning's ``"0,1"``; ``None`` where it is none of these (``"auto"``, ``-1``: Lightning counts
    them on the machine that runs). A ValueError naming ``source`` for a count or ``num_nodes`` below 1."""
    devices = trainer.get("devices")
    if isinstance(devices, str) and "," in devices:
        devices = [index for index in devices.split(",") if index.strip()]
    elif isinstance(devices, str) and devices.strip().isdigit():
        devices = int(devices)
    if isinstance(devices, (list, tuple)):
        devices = len(devices)
    if not isinstance(devices, int) or isinstance(devices, bool) or devices == -1:
        return None
    nodes = _positive_int(trainer.get("num_nodes", 1), "trainer.num_nodes", source) or 1
    return _positive_int(devices, "trainer.devices", source) * nodes  # type: ignore[operator]
