"""The autograd nodes that turn a layer's output gradient into per-sample parameter gradients."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Optional

import torch
import torch.nn.functional as F
from torch import nn

# Receives (layer, activation, grad_output) during backward.
GradientSink = Callable[[nn.Module, torch.Tensor, torch.Tensor], None]
# Receives (layer, parameter, its per-sample gradient (B, *shape)) during backward.
PerSampleGradientSink = Callable[[nn.Module, nn.Parameter, torch.Tensor], None]


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


class PerSampleLinear(torch.autograd.Function):
    """``nn.Linear``'s forward as one autograd node whose backward hands (input, output gradient) to a sink and
    returns only the input's gradient.

    The same values as the layer run with detached parameters behind a `PerSampleGradTap`, in one node instead of
    the tap, the matrix product's own nodes and a swap of the layer's parameters per call: at the tiny preset
    (micro-batch 4, CPU) the capture's forward costs about half as much over non-DP's (its backward the same). The
    input is saved with ``save_for_backward``, as the tap's, so activation checkpointing frees and recomputes it.
    The weight is saved as it is (no copy); under autocast its low-precision cast is formed again in backward
    instead of being held from forward to backward, as autograd's own matrix product node would hold it.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        sink: GradientSink,
        layer: nn.Linear,
        activation: torch.Tensor,
        weight: nn.Parameter,
        bias: Optional[nn.Parameter],
    ) -> torch.Tensor:
        ctx.sink, ctx.layer = sink, layer
        ctx.save_for_backward(activation, weight)
        return F.linear(activation, weight, bias)

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        activation, weight = ctx.saved_tensors
        ctx.sink(ctx.layer, activation, grad_output)
        if not ctx.needs_input_grad[2]:
            return None, None, None, None, None
        # In the forward's compute dtype (autocast's, that of the output), then cast to the input's, as autograd
        # forms it through autocast's cast node; a backward run inside autocast must not recast it.
        # Casts only where the dtypes differ: a same-dtype `.to` returns its input but still costs a dispatch (about
        # 10 us in backward, three per linear layer call).
        if weight.dtype != grad_output.dtype:
            weight = weight.to(grad_output.dtype)
        if torch.is_autocast_enabled(grad_output.device.type):
            with torch.autocast(grad_output.device.type, enabled=False):
                grad_input = grad_output.matmul(weight)
        else:
            grad_input = grad_output.matmul(weight)
        if grad_input.dtype != activation.dtype:
            grad_input = grad_input.to(activation.dtype)
        return None, None, grad_input, None, None


class PerSampleRMSNorm(torch.autograd.Function):
    """``nn.RMSNorm``'s forward, for an fp32 input and weight on CPU, as one autograd node whose backward
    hands the weight's per-sample gradient to a sink and returns only the input's gradient.

    On CPU torch forms an RMSNorm from six composite ops (a square, a mean, the epsilon's add, a reciprocal square
    root and two products), each with its backward node when it needs gradients, and the tap path then recomputed the
    normalisation for the sampler. This node runs the same ops once without recording them (``_fused_rms_norm``,
    composite on CPU: the same output bit for bit, and the reciprocal RMS ``r``) and forms in backward, from the saved
    input ``x`` and ``r``: the normalised input ``x r``, the per-sample weight gradient (the sum over the tokens of
    ``x r g``, the value of `normalization_gradients` without its recomputed normalisation) and the input gradient
    ``r (w g - x r mean(w g x r))``. At the tiny preset (micro-batch 4, T 256) a layer's forward and backward take
    about half of what the tap path took.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: Any,
        sink: PerSampleGradientSink,
        layer: nn.RMSNorm,
        activation: torch.Tensor,
        weight: nn.Parameter,
    ) -> torch.Tensor:
        output, rstd = torch.ops.aten._fused_rms_norm(activation, list(layer.normalized_shape), weight, layer.eps)
        ctx.sink, ctx.layer = sink, layer
        ctx.save_for_backward(activation, rstd, weight)
        return output

    @staticmethod
    def backward(ctx: Any, grad_output: torch.Tensor) -> tuple[Any, ...]:
        activation, rstd, weight = ctx.saved_tensors
        features = len(ctx.layer.normalized_shape)
        token_dims = tuple(range(1, activation.dim() - features))
        normalized = activation * rstd
        product = normalized * grad_output
        ctx.sink(ctx.layer, ctx.layer.weight, product.sum(token_dims) if token_dims else product)
        del product
        if not ctx.needs_input_grad[2]:
            return None, None, None, None
        feature_dims = tuple(range(activation.dim() - features, activation.dim()))
        scaled = grad_output * weight
        projection = (scaled * normalized).mean(feature_dims, keepdim=True)
        return None, None, scaled.sub_(normalized.mul_(projection)).mul_(rstd), None
