"""DP-safe activation checkpointing of transformer blocks (LongShield-V3).

Hook-based DP libraries keep a reference to every layer input from a forward hook, so checkpointing frees nothing
and the hook fires again on recomputation. Here per-sample gradients read their activations through autograd's
saved-tensor mechanism (`PerSampleGradTap`, `PerSampleLinear` and `PerSampleRMSNorm` save with
``save_for_backward``), which non-reentrant checkpointing controls: nothing captured in a checkpointed block's first
forward outlives it, and backward uses the recomputed activations. Layers outside checkpointed blocks are captured as
before.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional, Union

from torch import nn
from torch.utils.checkpoint import checkpoint

#: ``True``: every block; ``k`` (int): every k-th block (0, k, 2k, ...); a callable ``(index, block) -> bool``.
CheckpointPolicy = Union[bool, int, Callable[[int, nn.Module], bool]]


class CheckpointedForward:
    """A module's forward run under non-reentrant `torch.utils.checkpoint` (installed as the instance's forward;
    ``replaced``: the instance's own forward it replaced, if it had one, put back by `remove_activation_checkpointing`).

    The call's keyword arguments reach `checkpoint` as positional arguments, turned back into keywords inside:
    given to `checkpoint` by name they would be read as its own options (``debug``, ``context_fn``,
    ``determinism_check``, ``preserve_rng_state``, ``use_reentrant``), and bound outside it (a ``partial``) their
    tensors would be hidden from it, which saves and restores the RNG state (dropout's) only of the devices of the
    tensors it is given: a block called with keywords alone would recompute other dropout masks on a GPU.
    """

    def __init__(self, forward: Callable[..., Any], replaced: Optional[Callable[..., Any]] = None) -> None:
        self.forward = forward
        self.replaced = replaced

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not kwargs:
            return checkpoint(self.forward, *args, use_reentrant=False)
        names, count = list(kwargs), len(args)

        def forward(*values: Any) -> Any:
            return self.forward(*values[:count], **dict(zip(names, values[count:])))

        return checkpoint(forward, *args, *kwargs.values(), use_reentrant=False)


def transformer_blocks(module: nn.Module) -> list[nn.Module]:
    """The repeated blocks of a model: the children of every outermost `nn.ModuleList` (through lists of lists, as
    stages of blocks), in order, except trainable layers themselves (a list of ``nn.Linear``). A list inside a block
    (a mixture's experts) is part of that block: its members are neither counted by an ``int`` policy nor
    checkpointed apart (a checkpoint inside a checkpointed block recomputes its forward twice). A checkpoint of one
    layer would keep its input, all it saves anyway, and its recomputation would run outside the per-sample capture
    that the layer's first forward ran through."""
    outer: list[tuple[str, nn.ModuleList]] = []
    for name, child in module.named_modules():
        if isinstance(child, nn.ModuleList) and not any(_inside(name, found) for found, _ in outer):
            outer.append((name, child))
    return [block for _, blocks in outer for block in _members(blocks)
            if not any(param.requires_grad for param in block.parameters(recurse=False))]


def _members(blocks: nn.ModuleList) -> list[nn.Module]:
    """The list's members, looking through members that are lists themselves (blocks grouped in stages)."""
    return [found for block in blocks
            for found in (_members(block) if isinstance(block, nn.ModuleList) else [block])]


def _inside(name: str, outer: str) -> bool:
    """Whether the module named ``name`` lies under the one named ``outer`` (``""``: the root)."""
    return name != outer and (not outer or name.startswith(f"{outer}."))


def select_blocks(blocks: list[nn.Module], policy: CheckpointPolicy) -> list[nn.Module]:
    """The blocks ``policy`` checkpoints."""
    if policy is True:
        return list(blocks)
    if policy is False:
        return []
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"activation_checkpointing={policy}: an int policy checkpoints every k-th block, k >= 1.")
        return [block for index, block in enumerate(blocks) if index % policy == 0]
    if callable(policy):
        return [block for index, block in enumerate(blocks) if policy(index, block)]
    raise TypeError(f"activation_checkpointing must be a bool, an int or a callable, got {type(policy).__name__}.")


def apply_activation_checkpointing(module: nn.Module, policy: CheckpointPolicy = True) -> int:
    """Checkpoint the blocks of ``module`` chosen by ``policy``; returns how many. Idempotent."""
    blocks = transformer_blocks(module)
    if policy is not False and not blocks:
        raise TypeError(
            f"{type(module).__name__} has no nn.ModuleList of blocks to checkpoint (a list of trainable layers"
            " themselves, such as nn.Linear, is not checkpointed); keep the repeated blocks in an nn.ModuleList (as"
            " Llama.layers) or set activation_checkpointing=False."
        )
    selected = select_blocks(blocks, policy)
    for block in selected:
        own = block.__dict__.get("forward")
        if not isinstance(own, CheckpointedForward):
            block.forward = CheckpointedForward(block.forward, own)
    return len(selected)


def remove_activation_checkpointing(module: nn.Module) -> None:
    """Give every checkpointed block of ``module`` its forward back (after a fit): a wrapper left in place would run
    a layer frozen in that fit, and trainable in the next, inside a checkpoint beside its per-sample capture."""
    for child in module.modules():
        wrapper = child.__dict__.get("forward")
        if isinstance(wrapper, CheckpointedForward):
            if wrapper.replaced is None:
                del child.forward
            else:
                child.forward = wrapper.replaced
