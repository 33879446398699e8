"""How per-sample gradients computed from a sequence shard become complete per-sample gradients.

Under context parallelism each rank sees only its tokens, so the per-sample gradient ``einsum(BTp,BTd->Bpd)`` it
can compute locally is a partial sum. The exchanges below complete it (names follow the LongShield paper):

- `LocalExchange`: no context parallelism; the local result is complete.
- `AllReduceExchange` (V1): all-reduce the partials; every rank holds every complete per-sample gradient.
- `ReduceScatterExchange` (V2, input-stationary): reduce-scatter the partials (bucketed) so each rank holds the
  complete per-sample gradients of its parameter shard only; asynchronous, with each bucket's wait deferred until
  the next bucket is launched so the collective overlaps the backward of the layers in between.
- `OutputStationaryExchange` (V2, output-stationary): for linear layers, exchange the inputs instead (all-to-all the
  tensor whose feature dimension is sharded, all-gather the other) and compute the complete shard locally; other
  layer types fall back to the reduce-scatter.

Every exchange keys its results by parameter name, sums the uses of a parameter (a tied weight, an output layer
applied per chunk of the loss: uses that arrive back to back are summed before any collective, so a layer called
once per chunk costs one collective, not one per chunk), reports the bytes of
per-sample gradients it holds, and decides for its own layout whether squared norms need a sum over the group and
which slice the clipped sum keeps (`build_exchange` picks one from the strategy's settings). For per-layer clipping
(`deliver_each_parameter`) it hands over each parameter's per-sample gradient as soon as it is complete.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from lightning_longshield.dist_compat import reduce_scatter_single
from lightning_longshield.privacy.grad_sample.bookkeeping import gather_tokens
from lightning_longshield.privacy.grad_sample.layers import (
    add_embedding_gradients_,
    per_sample_gradients,
    token_outer_products,
)
from lightning_longshield.privacy.observer import DPStepObserver
from lightning_longshield.privacy.shards import ParamShard, local_tensor
from simulate.strategy_config import DEFAULT_BUCKET_MB

ParamNamer = Callable[[nn.Module, nn.Parameter], str]
# Receives complete per-sample gradients of some parameters, by name, and consumes them.
GradSampleSink = Callable[[dict[str, torch.Tensor]], None]


#: Default size of a reduce-scatter bucket: small per-sample gradients (norm weights, biases) travel together.
DEFAULT_BUCKET_BYTES = int(DEFAULT_BUCKET_MB * 2**20)


class LocalExchange:
    """No context parallelism: per-sample gradients of complete sequences, computed by the layer's Opacus sampler.

    An exchange owns one micro-batch's path from backward to "complete squared norms, and this rank's part of every
    per-sample gradient": `start_microbatch` says whether per-sample capture is needed (more than one sample), the
    capture feeds `receive` and takes `finish`; with one sample `summed_gradients` reads ``.grad`` instead (the
    summed gradient is that sample's); `complete_squared_norms` sums norms of shards over the group and
    `local_part` keeps the slice this rank's clipped sum accumulates.

    ``shards`` (with ``group=None``: only for parameters sharded over data-parallel replicas, ``shard_over="all"``)
    makes `local_part` lay each whole gradient out as this rank's padded part. ``always_capture``: capture even one
    sample, when FSDP2's summed ``.grad`` would mix the samples of several data-parallel replicas.

    ``held_bytes`` is what the exchange holds of complete per-sample gradients now, ``peak_held_bytes`` its maximum
    in the current micro-batch.
    """

    #: Whether a parameter's uses are summed in what this rank holds (no collective per use): a tied embedding's
    #: use is then added into the head's per-sample gradient row by row (`add_embedding_gradients_`).
    sums_uses_locally = True

    def __init__(
        self,
        group: Optional[dist.ProcessGroup] = None,
        shards: Optional[dict[str, ParamShard]] = None,
        always_capture: bool = False,
    ) -> None:
        self.group = group
        self.shards: dict[str, ParamShard] = shards or {}
        self.always_capture = always_capture
        self.grad_samples: dict[str, torch.Tensor] = {}
        self.held_bytes = 0
        self.peak_held_bytes = 0
        self.observer = DPStepObserver()
        self.capturing = False
        self._sink: Optional[GradSampleSink] = None
        self._uses: Mapping[str, int] = {}
        self._summing: Optional[_Summing] = None
        self._arrived: dict[str, int] = {}
        self._complete: list[str] = []
        self._delivered: set[str] = set()

    def deliver_each_parameter(self, sink: GradSampleSink, uses: Mapping[str, int]) -> None:
        """Hand each parameter's complete per-sample gradients to ``sink`` as soon as its ``uses[name]`` uses (layers
        that own it) have arrived, during backward, and forget them; the parameters completed by one step of the
        exchange (a reduce-scatter bucket) go together. Parameters some of whose owners did not run go at `finish`.
        """
        self._sink = sink
        self.count_uses(uses)

    def count_uses(self, uses: Mapping[str, int]) -> None:
        """Read each parameter's uses in the current micro-batch from ``uses`` (filled in the forward, read in
        backward): the partials of a parameter's uses that arrive back to back are summed before they go on."""
        self._uses = uses

    def start_microbatch(self, batch_size: int) -> bool:
        """Whether the next backward needs per-sample capture: with one sample ``.grad`` already is its gradient
        (unless ``always_capture``)."""
        self.capturing = batch_size > 1 or self.always_capture
        self.held_bytes = self.peak_held_bytes = 0
        self._summing = None
        self._arrived.clear()
        self._complete.clear()
        self._delivered.clear()
        return self.capturing

    def receive(self, layer: nn.Module, activation: torch.Tensor, grad_output: torch.Tensor, name_of: ParamNamer):
        if self.sums_uses_locally and type(layer) is nn.Embedding and layer.weight.requires_grad:
            name = name_of(layer, layer.weight)
            self._flush_summing()
            held = self.grad_samples.get(name)
            if held is not None and held.is_contiguous():  # another use's (a tied head's): add the rows into it
                add_embedding_gradients_(held, layer, activation, grad_output)
                self._count_arrival(name, 1)
                self._deliver()
                return
        summing = self._summing
        if summing is not None and _weight_only_linear(layer) and summing.name == name_of(layer, layer.weight) \
                and summing.total.dtype == grad_output.dtype and summing.total.is_contiguous():
            # Another use of the weight being summed (the head, chunk after chunk): its outer products are added
            # into the running sum, not formed beside it.
            token_outer_products(grad_output, activation.to(grad_output.dtype), add_to=summing.total)
            self._add_use(summing)
            return
        for param, grad_sample in per_sample_gradients(layer, activation, grad_output).items():
            self.store(name_of(layer, param), grad_sample)

    def store(self, name: str, grad_sample: torch.Tensor) -> None:
        """Take one parameter's (partial) per-sample gradient ``(B, *shape)``, computed from this rank's tokens."""
        self.observer.per_sample_gradient(grad_sample)
        summing = self._summing
        if summing is not None and summing.name == name:
            summing.total.add_(grad_sample)  # the first use's tensor is the exchange's own
        else:
            self._flush_summing()
            self._summing = summing = _Summing(name, grad_sample)
        self._add_use(summing)

    def _add_use(self, summing: _Summing) -> None:
        """Count the use just added into ``summing``; pass the sum on once every use has arrived."""
        summing.uses += 1
        if summing.uses >= self._uses.get(summing.name, 1):
            self._flush_summing()
        self._deliver()

    def _flush_summing(self) -> None:
        """Pass on the partial summed over the uses that arrived back to back."""
        if self._summing is not None:
            summing, self._summing = self._summing, None
            self._store(summing.name, summing.total, summing.uses)

    def _store(self, name: str, grad_sample: torch.Tensor, uses: int = 1) -> None:
        """Add ``uses`` uses' complete per-sample gradient (this rank's part of it) to what the exchange holds."""
        if name in self._delivered:
            raise RuntimeError(
                f"{name} received another per-sample gradient after its per-layer clipping: a module that owns it ran"
                " more than once in the forward. Per-layer clipping needs each owning module called once per"
                " forward; use clipping='flat'."
            )
        previous = self.grad_samples.get(name)
        if previous is None:
            self.grad_samples[name] = grad_sample
            self.held_bytes += _nbytes(grad_sample)
            self.peak_held_bytes = max(self.peak_held_bytes, self.held_bytes)
        else:  # in place: the first use's tensor is the exchange's own, and a third (B, *shape) buffer would not fit
            previous.add_(grad_sample)
        self._count_arrival(name, uses)

    def _count_arrival(self, name: str, uses: int) -> None:
        """``uses`` more uses of ``name`` are in what the exchange holds (per-layer clipping delivers it when all
        have arrived)."""
        if self._sink is not None:
            self._arrived[name] = self._arrived.get(name, 0) + uses
            if self._arrived[name] == self._uses.get(name, 1):
                self._complete.append(name)

    def _deliver(self) -> None:
        """Hand the parameters completed since the last delivery to the sink (per-layer clipping only)."""
        if not self._complete:
            return
        assert self._sink is not None
        group = {name: self.grad_samples.pop(name) for name in self._complete}
        self._delivered.update(self._complete)
        self._complete = []
        self.held_bytes -= sum(_nbytes(grad) for grad in group.values())
        self._sink(group)

    def finish(self) -> dict[str, torch.Tensor]:
        """The captured per-sample gradients of the last backward (the exchange forgets them); those not yet
        delivered go to the sink instead, if there is one."""
        self._flush_summing()
        if self._sink is not None:
            self._complete.extend(name for name in self.grad_samples if name not in self._complete)
            self._deliver()
        grads, self.grad_samples = self.grad_samples, {}
        self.held_bytes = 0
        return grads

    def summed_gradients(self, parameters: dict[str, nn.Parameter]) -> dict[str, torch.Tensor]:
        """A one-sample micro-batch's gradients: every ``.grad`` (its local shard under FSDP2) as a batch of one.

        The ``.grad`` attributes are cleared: the clipped sum is the only copy that outlives the micro-batch.
        """
        grads = {name: local_tensor(p.grad).unsqueeze(0) for name, p in parameters.items() if p.grad is not None}
        for param in parameters.values():
            param.grad = None
        return grads

    def complete_squared_norms(self, squared_norms: torch.Tensor) -> torch.Tensor:
        """Per-sample squared norms over all parameters, from those of the gradients this rank holds."""
        return squared_norms

    def local_part(self, grad_samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The part of each per-sample gradient this rank's clipped sum keeps (its parameter shard)."""
        if self.group is not None or not self.shards:
            return grad_samples
        return {name: self.shards[name].take(grad, offset=1) for name, grad in grad_samples.items()}


class AllReduceExchange(LocalExchange):
    """LongShield-V1: all-reduce each partial per-sample gradient over the context-parallel group.

    Every rank then holds complete per-sample gradients of every parameter, so their norms need no communication;
    after clipping, each rank keeps the slice of its FSDP2 shard. A one-sample micro-batch goes through FSDP2's
    reduce-scatter instead, whose shards' squared norms are summed over the group.
    """

    sums_uses_locally = False  # each use's partial is reduced over the group as it arrives

    def __init__(self, group: dist.ProcessGroup, shards: dict[str, ParamShard], always_capture: bool = False) -> None:
        super().__init__(group, shards, always_capture)

    def _store(self, name: str, grad_sample: torch.Tensor, uses: int = 1) -> None:
        dist.all_reduce(grad_sample, group=self.group)
        super()._store(name, grad_sample, uses)

    def complete_squared_norms(self, squared_norms: torch.Tensor) -> torch.Tensor:
        if not self.capturing:
            dist.all_reduce(squared_norms, group=self.group)
        return squared_norms

    def local_part(self, grad_samples: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        if not self.capturing:
            return grad_samples
        return {name: self.shards[name].take(grad, offset=1) for name, grad in grad_samples.items()}


class ReduceScatterExchange(LocalExchange):
    """LongShield-V2 (input-stationary): asynchronous reduce-scatter of each partial to the owner of each shard.

    Partials are bucketed: consecutive ones of one dtype travel in one reduce-scatter once the bucket holds
    ``bucket_bytes`` (0: one collective per parameter), so small parameters do not cost one collective each. With
    ``overlap`` one bucket stays in flight while the backward of the next layers runs.
    """

    sums_uses_locally = False  # each use's partial is reduced over the group as it arrives

    def __init__(
        self,
        group: dist.ProcessGroup,
        shards: dict[str, ParamShard],
        overlap: bool = True,
        bucket_bytes: int = DEFAULT_BUCKET_BYTES,
        always_capture: bool = False,
    ) -> None:
        super().__init__(group, shards, always_capture)
        self.overlap = overlap
        self.bucket_bytes = bucket_bytes
        self._bucket: list[tuple[str, torch.Tensor, int]] = []
        self._bucket_size = 0
        self._pending: list[tuple[dist.Work, list[tuple[str, torch.Tensor, int]], torch.Tensor]] = []

    def _store(self, name: str, grad_sample: torch.Tensor, uses: int = 1) -> None:
        chunks = self.shards[name].padded_chunks_first(grad_sample, offset=1)
        if self._bucket and self._bucket[0][1].dtype != chunks.dtype:
            self._launch_bucket()
        self._bucket.append((name, chunks, uses))
        self._bucket_size += chunks.numel() * chunks.element_size()
        if self._bucket_size >= self.bucket_bytes:
            self._launch_bucket()
            # Keep one collective in flight: it overlaps the data-gradient compute of the next layers down.
            self._wait(keep=1 if self.overlap else 0)

    def _launch_bucket(self) -> None:
        if not self._bucket:
            return
        bucket, self._bucket, self._bucket_size = self._bucket, [], 0
        if len(bucket) == 1:
            flat = bucket[0][1]
        else:
            flat = torch.cat([chunks.flatten(1) for _, chunks, _ in bucket], dim=1)
        output = torch.empty_like(flat[:1])
        work = reduce_scatter_single(output, flat, group=self.group, async_op=True)
        self._pending.append((work, bucket, output))

    def _wait(self, keep: int) -> None:
        while len(self._pending) > keep:
            work, bucket, output = self._pending.pop(0)
            work.wait()
            pieces = (output[0].split([chunks[0].numel() for _, chunks, _ in bucket]) if len(bucket) > 1
                      else [output[0]])
            for (name, chunks, uses), piece in zip(bucket, pieces):
                super()._store(name, self.shards[name].from_chunk(piece.view(chunks.shape[1:]), offset=1), uses)

    def finish(self) -> dict[str, torch.Tensor]:
        self._flush_summing()
        self._launch_bucket()
        self._wait(keep=0)
        return super().finish()

    def complete_squared_norms(self, squared_norms: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(squared_norms, group=self.group)
        return squared_norms


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
            activation = gather_tokens(activation, self.group)
        else:  # input features sharded: all-to-all the input, all-gather the output gradient
            activation = _all_to_all_features(activation, shard, self.group)
            grad_output = gather_tokens(grad_output, self.group)
        weight = token_outer_products(grad_output, activation)
        LocalExchange._store(self, name, shard.from_chunk(weight.movedim(shard.dim + 1, -1), offset=1))
        self._deliver()


def _weight_only_linear(layer: nn.Module) -> bool:
    """A linear layer whose weight trains and whose bias, if any, does not (its per-sample gradient is the weight's
    outer products alone)."""
    return type(layer) is nn.Linear and layer.weight.requires_grad and (layer.bias is None
                                                                          or not layer.bias.requires_grad)


class _Summing:
    """One parameter's partial per-sample gradient, summed over the uses that arrived back to back."""

    def __init__(self, name: str, total: torch.Tensor) -> None:
        self.name, self.total, self.uses = name, total, 0  # `LocalExchange._add_use` counts the first


def _nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def _all_to_all_features(x: torch.Tensor, shard: ParamShard, group: dist.ProcessGroup) -> torch.Tensor:
    """(B, T_local, F) -> (B, world * T_local, padded chunk of F owned here), tokens ordered as in the gather."""
    features = replace(shard, dim=x.dim() - 1)
    chunks = features.padded_chunks_first(x)
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received.movedim(0, 1).flatten(1, 2)


def build_exchange(
    group: dist.ProcessGroup,
    shards: dict[str, ParamShard],
    exchange: str = "reduce_scatter",
    overlap: bool = True,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> LocalExchange:
    """The exchange for a layout: local on a one-rank group (CP 1: every shard is the whole parameter), else the
    configured one over the context-parallel ``group``: ``"all_reduce"`` (V1), ``"reduce_scatter"`` (V2, input
    stationary) or ``"output_stationary"`` (`StrategyConfig.exchange`, which has validated it with the layout).

    ``shards`` over data-parallel replicas (``ParamShard.replicas > 1``, FSDP2 over the whole mesh) make every
    micro-batch take the per-sample path: FSDP2's ``.grad`` of one sample would be summed over the replicas."""
    replicated = any(shard.replicas > 1 for shard in shards.values())
    if dist.get_world_size(group) == 1:
        return LocalExchange(None, shards if replicated else None, always_capture=replicated)
    if exchange == "all_reduce":
        return AllReduceExchange(group, shards, replicated)
    if exchange == "output_stationary":
        return OutputStationaryExchange(group, shards, overlap, bucket_bytes)
    return ReduceScatterExchange(group, shards, overlap, bucket_bytes, replicated)
