"""Which layer types have per-sample gradients, and the Opacus sampler that computes them.

Every supported sampler is a sum over the token dimension of a per-token outer product (or a per-token scatter),
so a partial per-sample gradient over a shard of the tokens is meaningful and shards sum to the full one.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from opacus.grad_sample import GradSampleModule
from torch import nn

# Maps (layer, [activation], grad_output) -> {parameter: per-sample gradient (B, *parameter.shape)}.
GradSampler = Callable[[nn.Module, list[torch.Tensor], torch.Tensor], dict[nn.Parameter, torch.Tensor]]

SUPPORTED_LAYER_TYPES: tuple[type[nn.Module], ...] = (nn.Linear, nn.Embedding, nn.RMSNorm, nn.LayerNorm)


def per_sample_gradients(
    layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor
) -> dict[nn.Parameter, torch.Tensor]:
    """``(B, *shape)`` per-sample gradients of ``layer``'s trainable parameters by Opacus's registered sampler for its
    exact type; an embedding's padding row gets none, as from autograd (Opacus's sampler scatters into it)."""
    if isinstance(layer, nn.Embedding):
        grad_output = without_padding(layer, activation, grad_output)
    sampler: GradSampler = GradSampleModule.GRAD_SAMPLERS[type(layer)]
    return sampler(layer, [activation], grad_output)


def without_padding(layer: nn.Embedding, ids: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """An embedding's output gradients ``(..., d)`` with those of its padding tokens zeroed."""
    if layer.padding_idx is None:
        return grad_output
    return grad_output * (ids != layer.padding_idx).unsqueeze(-1)


def trainable_layers(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """Modules that directly own a trainable parameter, with their qualified names."""
    return [
        (name, module)
        for name, module in model.named_modules()
        if any(p.requires_grad for p in module.parameters(recurse=False))
    ]


def check_supported_layers(model: nn.Module) -> None:
    """Raise a `TypeError` listing every trainable layer whose per-sample gradient cannot be computed."""
    unsupported = [
        f"{name or '<root>'} ({type(module).__name__})"
        for name, module in trainable_layers(model)
        if type(module) not in SUPPORTED_LAYER_TYPES
    ]
    if unsupported:
        supported = ", ".join(t.__name__ for t in SUPPORTED_LAYER_TYPES)
        raise TypeError(
            "DP-SGD needs per-sample gradients for every trainable parameter, but these layers are not supported: "
            + "; ".join(unsupported)
            + f". Supported layer types: {supported}. Freeze these layers (requires_grad=False) or rebuild them from"
            " the supported types."
        )
