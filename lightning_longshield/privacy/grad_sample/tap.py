"""The autograd node that turns a layer's output gradient into per-sample parameter gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

# Receives (layer, activation, grad_output) during backward.
GradientSink = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]


class PerSampleGradTap(torch.autograd.Function):
    """Identity on the layer output that, in backward, hands (activation, output gradient) to a sink.

    The layer ran with detached parameters, so autograd never forms the summed weight gradient; this node is the
    only place parameter gradients are computed. The activation is saved with ``save_for_backward``, so activation
    checkpointing frees it after the first forward and the node sees the recomputed tensor in backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        sink: GradientSink,
        layer: nn.Module,
        output: torch.Tensor,
        activation: torch.Tensor,
        *parameters: nn.Parameter,
    ) -> torch.Tensor:
        ctx.sink, ctx.layer, ctx.num_parameters = sink, layer, len(parameters)
        ctx.save_for_backward(activation)
        # An alias without view tracking (``view_as`` would make every sharded model's output a view, which FSDP2
        # warns about); autograd still routes the output's gradient through this node.
        return output.detach()

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        (activation,) = ctx.saved_tensors
        ctx.sink(ctx.layer, activation, grad_output)
        return (None, None, grad_output, None) + (None,) * ctx.num_parameters
