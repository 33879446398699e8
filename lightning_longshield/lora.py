"""LoRA adapters (PEFT) on `Llama`: only the adapters train, so only they take per-sample gradients and noise.

PEFT wraps each targeted ``nn.Linear`` as ``lora.Linear`` with a frozen ``base_layer`` and two small trainable
``nn.Linear`` adapters, ``lora_A`` (in -> r) and ``lora_B`` (r -> out), adding ``scaling * B(A(dropout(x)))`` to the
base output. The adapters are plain linear layers, so the per-sample capture, the CP exchanges and FSDP2 treat them
like any other; frozen base weights take no per-sample memory, no clipped-sum buffer and no optimizer state.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, fields
from typing import Any, Literal, Optional, Union

import torch
from torch import nn

from lightning_longshield.hf import require_hf
from simulate.specs import DEFAULT_LORA_RANK, LORA_TARGETS

#: Hugging Face (PEFT recipe) names of Llama's linear layers -> `Llama`'s own.
HF_TARGET_NAMES = {
    "q_proj": "wq", "k_proj": "wk", "v_proj": "wv", "o_proj": "wo", "gate_proj": "w1", "up_proj": "w3",
    "down_proj": "w2", "lm_head": "output",
}
#: The linear layers of `Llama` that LoRA can adapt: every block projection and the output head.
TARGET_NAMES = (*LORA_TARGETS, "output")
#: PEFT's name for every linear layer but the output head (a `Literal` in the field's type: a command line's
#: ``--model.lora.target_modules all-linear`` then parses as the field, not as a mapping replacing the whole entry).
AllLinear = Literal["all-linear"]
ALL_LINEAR: AllLinear = "all-linear"


@dataclass(frozen=True)
class LoraOptions:
    """LoRA hyper-parameters: adapter ``rank``, ``alpha`` (the update is scaled by ``alpha / rank``), ``dropout`` on
    the adapter input, and the linear layers to adapt, by name (default: every projection of every block).

    ``target_modules`` takes `Llama`'s names (``wq wk wv wo w1 w2 w3 output``) or the Hugging Face names of PEFT
    recipes (``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj lm_head``), which are stored as `Llama`'s,
    or PEFT's ``"all-linear"``: every block projection, not the output head (as PEFT takes it); any other name is
    refused."""

    rank: int = DEFAULT_LORA_RANK
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: Union[AllLinear, Sequence[str]] = LORA_TARGETS

    def __post_init__(self) -> None:
        if isinstance(self.rank, bool) or not isinstance(self.rank, (int, float)) or int(self.rank) != self.rank \
                or self.rank < 1:
            raise ValueError(f"LoRA rank must be a positive integer, got {self.rank!r}.")
        object.__setattr__(self, "rank", int(self.rank))  # 4.0 (a YAML or JSON number) builds adapters of rank 4
        if self.alpha <= 0:
            raise ValueError(f"LoRA alpha must be positive, got {self.alpha!r}.")
        if not 0 <= self.dropout < 1:
            raise ValueError(f"LoRA dropout must be in [0, 1), got {self.dropout!r}.")
        if self.target_modules == ALL_LINEAR:
            object.__setattr__(self, "target_modules", LORA_TARGETS)
        if isinstance(self.target_modules, str) or not self.target_modules:
            raise ValueError(
                f"target_modules must be a non-empty list of layer names, e.g. {list(LORA_TARGETS)}, or"
                f" {ALL_LINEAR!r}; got {self.target_modules!r}."
            )
        unknown = [name for name in self.target_modules if name not in TARGET_NAMES and name not in HF_TARGET_NAMES]
        if unknown:
            raise ValueError(
                f"Unknown LoRA target_modules {unknown}: valid names are {list(TARGET_NAMES)} or their Hugging Face"
                f" names {list(HF_TARGET_NAMES)}."
            )
        names = (HF_TARGET_NAMES.get(name, name) for name in self.target_modules)
        object.__setattr__(self, "target_modules", tuple(dict.fromkeys(names)))

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any]) -> LoraOptions:
        """`LoraOptions` from a mapping of its fields (e.g. a YAML ``lora:`` section); a ValueError naming the
        valid keys for any other key."""
        keys = [f.name for f in fields(cls)]
        unknown = [key for key in options if key not in keys]
        if unknown:
            raise ValueError(f"Unknown LoRA option(s) {unknown}: the valid keys are {keys}.")
        return cls(**options)

    def peft_config(self) -> Any:
        """The equivalent ``peft.LoraConfig``."""
        peft = require_hf("peft")
        return peft.LoraConfig(
            r=self.rank, lora_alpha=self.alpha, lora_dropout=self.dropout, target_modules=list(self.target_modules),
            bias="none",
        )


def apply_lora(model: nn.Module, options: LoraOptions) -> nn.Module:
    """Inject LoRA adapters into ``model`` in place and freeze every other parameter; returns ``model``.

    Raises a `ValueError` listing the model's linear layer names when ``options.target_modules`` matches none.
    """
    peft = require_hf("peft")
    try:
        peft.inject_adapter_in_model(options.peft_config(), model)
    except ValueError as error:  # PEFT's "Target modules ... not found in the base model"
        names = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if type(m) is nn.Linear})
        raise ValueError(
            f"LoRA target_modules {list(options.target_modules)} match no layer of {type(model).__name__}; its linear"
            f" layers are named {names}."
        ) from error
    for name, param in model.named_parameters():
        param.requires_grad_(is_adapter_parameter(name))
    return model


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter (or state) called ``name`` belongs to a LoRA adapter."""
    return ".lora_" in name


def is_lora_layer(module: nn.Module) -> bool:
    """Whether ``module`` is a PEFT LoRA wrapper (a frozen ``base_layer`` plus adapters)."""
    return hasattr(module, "base_layer") and isinstance(getattr(module, "lora_A", None), nn.ModuleDict)


def reset_adapters(model: nn.Module) -> None:
    """Initialise every LoRA adapter as PEFT does (A random, B zero): after a meta-device model is materialised."""
    for module in model.modules():
        if is_lora_layer(module):
            for adapter in list(module.lora_A):
                module.reset_lora_parameters(adapter, True)


@dataclass
class MergedUpdates:
    """How much of the LoRA updates merged into base weights survives their rounding to ``dtype`` (an export's):
    sums over the merged weights of ``||update||^2`` and of ``||rounded - base - update||^2``."""

    dtype: torch.dtype
    squared: float = 0.0
    lost: float = 0.0

    def add(self, base: torch.Tensor, merged: torch.Tensor, rows: int = 4096) -> None:
        """Count one merged weight, ``rows`` rows at a time (a few fp32 copies of a block, not of the weight)."""
        for start in range(0, merged.shape[0], rows):
            old, new = base[start:start + rows].float(), merged[start:start + rows].float()
            update = new - old
            lost = new.to(self.dtype).float().sub_(old.to(self.dtype).float()).sub_(update)
            self.squared += float(update.double().square().sum())
            self.lost += float(lost.double().square().sum())

    @property
    def relative_error(self) -> float:
        """``||rounded update - update|| / ||update||`` over every merged weight (0 without updates)."""
        return math.sqrt(self.lost / self.squared) if self.squared > 0 else 0.0


@torch.no_grad()
def merged_tensors(model: nn.Module, keep: bool = True,
                   updates: Optional[MergedUpdates] = None) -> Iterator[tuple[str, torch.Tensor]]:
    """The model's full (unsharded) tensors on the CPU, one at a time in `state_dict` order, with every LoRA adapter
    merged into its base weight under the base model's parameter name: ``W + scaling * B @ A`` (yielded once its
    base weight and adapters have all been gathered). FSDP2 shards are gathered one tensor at a time, a collective:
    every rank iterates to the end. ``keep=False`` (the ranks that do not write) takes part in every gather and
    yields nothing, so only one rank holds host copies, and only as long as its consumer keeps them. ``updates``
    measures what rounding to an export's dtype leaves of the merged updates."""
    lora_prefixes = {name for name, module in model.named_modules() if is_lora_layer(module)}
    pending: dict[str, dict[str, torch.Tensor]] = {}  # a LoRA layer's gathered parts until the last one arrives
    for name, value in model.state_dict().items():
        whole = _whole(value)
        if not keep:
            del whole
            continue
        tensor = whole.detach().to("cpu")
        del whole
        prefix = _lora_prefix(name, lora_prefixes)
        if prefix is None:
            if is_adapter_parameter(name) or ".base_layer." in name:
                raise ValueError(f"Cannot merge this LoRA tensor into a base weight: {name}.")
            yield name, tensor
            continue
        parts = pending.setdefault(prefix, {})
        parts[name[len(prefix) + 1:]] = tensor
        module = model.get_submodule(prefix)
        adapters = list(module.lora_A)
        needed = {"base_layer.weight", *(f"lora_{side}.{adapter}.weight" for adapter in adapters for side in "AB")}
        if needed <= parts.keys():
            del pending[prefix]
            weight = base = parts.pop("base_layer.weight")
            for adapter in adapters:
                a, b = parts.pop(f"lora_A.{adapter}.weight"), parts.pop(f"lora_B.{adapter}.weight")
                weight = weight + (module.scaling[adapter] * (b.float() @ a.float())).to(weight.dtype)
            if parts:
                raise ValueError(f"Cannot merge these LoRA tensors into a base weight: {sorted(parts)} of {prefix}.")
            if updates is not None:
                updates.add(base, weight)
            del base
            yield f"{prefix}.weight", weight
    if pending:
        raise ValueError(f"Cannot merge these LoRA tensors into a base weight: {sorted(pending)} lack parts.")


def _lora_prefix(name: str, prefixes: set[str]) -> Optional[str]:
    """The LoRA layer whose base weight or adapter the state entry ``name`` is, if any."""
    for marker in (".base_layer.", ".lora_"):
        head, found, _ = name.partition(marker)
        if found and head in prefixes:
            return head
    return None


def _whole(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor
