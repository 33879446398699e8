"""How per-sample gradients computed from a sequence shard become complete per-sample gradients.

Under context parallelism each rank sees only its tokens, so the per-sample gradient ``einsum(BTp,BTd->Bpd)`` it
can compute locally is a partial sum. The exchanges below complete it (names follow the LongShield paper):

- `LocalExchange`: no context parallelism; the local result is complete.
- `AllReduceExchange` (V1): all-reduce the partials; every rank holds every complete per-sample gradient.
- `ReduceScatterExchange` (V2, input-stationary): reduce-scatter the partials so each rank holds the complete
  per-sample gradients of its parameter shard only; asynchronous, with each layer's wait deferred until the next
  layer's gradient arrives so the collective overlaps the backward of the layer in between.
- `OutputStationaryExchange` (V2, output-stationary): for linear layers, exchange the inputs instead (all-to-all the
  tensor whose feature dimension is sharded, all-gather the other) and compute the complete shard locally; other
  layer types fall back to the reduce-scatter.

Every exchange keys its results by parameter name, sums the uses of a shared (tied) parameter, and reports the
bytes of per-sample gradients it holds.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.privacy.grad_sample.layers import grad_sampler_for
from lightning_longshield.privacy.observer import DPStepObserver
from lightning_longshield.privacy.shards import ParamShard

ParamNamer = Callable[[nn.Module, nn.Parameter], str]


class LocalExchange:
    """Per-sample gradients of complete sequences: computed by the layer's Opacus sampler, kept as they are."""

    #: Whether the held per-sample gradients are shards whose squared norms must be summed over the CP group.
    holds_shards = False

    def __init__(self) -> None:
        self.grad_samples: dict[str, torch.Tensor] = {}
        self.held_bytes = 0
        self.observer = DPStepObserver()

    def receive(self, layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor, name_of: ParamNamer):
        for param, grad_sample in grad_sampler_for(layer)(layer, [activation], grad_output).items():
            self.observer.per_sample_gradient(grad_sample)
            self._store(name_of(layer, param), grad_sample)

    def _store(self, name: str, grad_sample: torch.Tensor) -> None:
        previous = self.grad_samples.get(name)
        self.grad_samples[name] = grad_sample if previous is None else previous + grad_sample
        if previous is None:
            self.held_bytes += grad_sample.numel() * grad_sample.element_size()

    def finish(self) -> dict[str, torch.Tensor]:
        """The per-sample gradients of the last backward (the exchange forgets them)."""
        grads, self.grad_samples = self.grad_samples, {}
        return grads


class AllReduceExchange(LocalExchange):
    """LongShield-V1: all-reduce each partial per-sample gradient over the context-parallel group."""

    def __init__(self, group: dist.ProcessGroup) -> None:
        super().__init__()
        self.group = group

    def _store(self, name: str, grad_sample: torch.Tensor) -> None:
        dist.all_reduce(grad_sample, group=self.group)
        super()._store(name, grad_sample)


class ReduceScatterExchange(LocalExchange):
    """LongShield-V2 (input-stationary): asynchronous reduce-scatter of each partial to the owner of each shard."""

    holds_shards = True

    def __init__(self, group: dist.ProcessGroup, shards: dict[str, ParamShard], overlap: bool = True) -> None:
        super().__init__()
        self.group = group
        self.shards = shards
        self.overlap = overlap
        self._pending: list[tuple[dist.Work, str, torch.Tensor]] = []

    def _store(self, name: str, grad_sample: torch.Tensor) -> None:
        chunks = self.shards[name].padded_chunks_first(grad_sample, offset=1)
        output = torch.empty_like(chunks[:1])
        work = dist.reduce_scatter_tensor(output, chunks, group=self.group, async_op=True)
        self._pending.append((work, name, output))
        # Keep one collective in flight: it overlaps the data-gradient compute of the next layer down.
        self._wait(keep=1 if self.overlap else 0)

    def _wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            work, name, output = self._pending.pop(0)
            work.wait()
            super()._store(name, self.shards[name].from_chunk(output[0], offset=1))

    def finish(self) -> dict[str, torch.Tensor]:
        self._wait(keep=0)
        return super().finish()


class OutputStationaryExchange(ReduceScatterExchange):
    """LongShield-V2 (output-stationary): linear layers exchange inputs, then compute their shard locally."""

    def receive(self, layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor, name_of: ParamNamer):
        if type(layer) is not nn.Linear or (layer.bias is not None and layer.bias.requires_grad):
            return super().receive(layer, activation, grad_output, name_of)
        name = name_of(layer, layer.weight)
        shard = self.shards[name]
        activation = activation.to(grad_output.dtype)
        if shard.dim == 0:  # output features sharded: all-to-all the output gradient, all-gather the input
            grad_output = _all_to_all_features(grad_output, shard, self.group)
            activation = _all_gather_tokens(activation, shard.world, self.group)
        else:  # input features sharded: all-to-all the input, all-gather the output gradient
            activation = _all_to_all_features(activation, shard, self.group)
            grad_output = _all_gather_tokens(grad_output, shard.world, self.group)
        weight = torch.einsum("b...o,b...i->boi", grad_output, activation)
        LocalExchange._store(self, name, shard.from_chunk(weight.movedim(shard.dim + 1, -1), offset=1))


def _all_gather_tokens(x: torch.Tensor, world: int, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T_local, F) -> (B, world * T_local, F), the ranks' tokens in rank order."""
    gathered = torch.empty((world, *x.shape), dtype=x.dtype, device=x.device)
    dist.all_gather_into_tensor(gathered, x.unsqueeze(0).contiguous(), group=group)
    return gathered.movedim(0, 1).flatten(1, 2)


def _all_to_all_features(x: torch.Tensor, shard: ParamShard, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T_local, F) -> (B, world * T_local, padded chunk of F owned here), tokens ordered as in the gather."""
    features = replace(shard, dim=x.dim() - 1)
    chunks = features.padded_chunks_first(x)
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received.movedim(0, 1).flatten(1, 2)
