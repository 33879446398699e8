"""The clipped-gradient sum of one logical batch and its noisy release."""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.privacy.grad_sample.capture import local_tensor
from lightning_longshield.privacy.noise import GaussianNoise
from lightning_longshield.privacy.shards import ParamShard


class ClippedGradientSum:
    """fp32 running sums, per parameter name, of clipped per-sample gradients over one logical batch.

    A sum has the shape of the per-sample gradients it receives: the local shard of the parameter, or (V1) the
    whole parameter, of which `release` keeps the local shard. `release` adds the sums of all data-parallel groups,
    adds ``N(0, (sigma C)^2)`` once per coordinate (identical draws on every data-parallel replica of a shard, so
    the noise enters once), divides by the expected logical batch size, writes ``param.grad`` (a DTensor shard for
    FSDP2 parameters) and resets the sums.
    """

    def __init__(
        self,
        parameters: dict[str, nn.Parameter],
        shards: Optional[dict[str, ParamShard]] = None,
        data_parallel_group: Optional[dist.ProcessGroup] = None,
    ) -> None:
        self.parameters = parameters
        self.shards = shards or {}
        self.data_parallel_group = data_parallel_group
        self.sums: dict[str, torch.Tensor] = {}

    def add(self, grad_samples: dict[str, torch.Tensor], factors: torch.Tensor) -> None:
        """Add ``sum_i factors[i] * grad_samples[name][i]`` for every parameter."""
        for name, grad_sample in grad_samples.items():
            clipped = torch.tensordot(factors.to(grad_sample.dtype), grad_sample, dims=1)
            if name in self.sums:
                self.sums[name].add_(clipped)
            else:
                self.sums[name] = clipped.float()

    @torch.no_grad()
    def release(self, noise: GaussianNoise, noise_std: float, expected_batch_size: float) -> None:
        """Privatise the sums into ``param.grad`` and start a new logical batch."""
        for name, param in self.parameters.items():
            local = local_tensor(param)
            total = self.sums.get(name)
            if total is None:
                total = torch.zeros(local.shape, dtype=torch.float32, device=local.device)
            elif total.shape != local.shape:
                total = self.shards[name].take(total)
            if self.data_parallel_group is not None:
                total = total.contiguous()
                dist.all_reduce(total, group=self.data_parallel_group)
            if noise_std > 0:
                total = total + noise.sample(total.shape, noise_std, total.device)
            param.grad = _like_parameter(param, (total / expected_batch_size).to(param.dtype))
        self.sums.clear()


def _like_parameter(param: nn.Parameter, local: torch.Tensor) -> torch.Tensor:
    """``local`` as a gradient for ``param``: wrapped as a DTensor shard when the parameter is one."""
    if not hasattr(param, "device_mesh"):
        return local
    from torch.distributed.tensor import DTensor

    return DTensor.from_local(
        local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
    )
