"""Parallelism applied from outside the model: activation checkpointing, CP attention and FSDP2 over the CP group."""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from typing import Literal, Optional

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import Shard

from lightning_longshield.activation_checkpointing import (
    CheckpointPolicy,
    apply_activation_checkpointing,
    select_blocks,
)
from lightning_longshield.context_parallel import apply_context_parallel_attention
from lightning_longshield.lora import reset_adapters
from lightning_longshield.privacy.grad_sample.bookkeeping import PER_SAMPLE_METHODS, PerSampleMethod
from lightning_longshield.privacy.grad_sample.exchange import DEFAULT_BUCKET_BYTES, LocalExchange, build_exchange
from lightning_longshield.privacy.per_layer import Clipping, PerLayerKernel, ThresholdSpec, check_clipping
from lightning_longshield.privacy.randomized.estimator import check_norm_estimator
from lightning_longshield.privacy.randomness import derive_seed
from lightning_longshield.privacy.shards import ParamShard

GRAD_SAMPLE_PATTERNS = ("input_stationary", "output_stationary")
SHARD_OVER = ("context_parallel", "all")


@dataclass(frozen=True)
class DPParallelism:
    """How a DP step is parallelised: CP size, the per-sample exchange (V1 / V2 and its pattern), communication
    overlap and bucketing, activation checkpointing (V3), how linear and embedding weights get per-sample norms
    (materialised, ghost or mixed, with book-keeping; or estimated by random projections) and whether each sample is
    clipped as a whole (flat) or layer by layer as its gradients complete (per-layer). The strategy's arguments of the
    same names."""

    context_parallel_size: Optional[int] = None
    shard_per_sample_grads: bool = True
    grad_sample_pattern: Literal["input_stationary", "output_stationary"] = "input_stationary"
    overlap_communication: bool = True
    communication_bucket_mb: float = DEFAULT_BUCKET_BYTES / 2**20
    activation_checkpointing: CheckpointPolicy = False
    per_sample: PerSampleMethod = "materialize"
    shard_over: Literal["context_parallel", "all"] = "context_parallel"
    clipping: Clipping = "flat"
    per_layer_thresholds: Optional[ThresholdSpec] = None
    per_layer_kernel: PerLayerKernel = "auto"
    norm_estimator: Literal["exact", "hutchinson", "hutchpp"] = "exact"
    projection_dim: int = 32

    def __post_init__(self) -> None:
        if self.shard_over not in SHARD_OVER:
            raise ValueError(f"shard_over={self.shard_over!r}; choose one of {SHARD_OVER}.")
        if self.shard_over == "all" and self.output_stationary:
            raise ValueError("grad_sample_pattern='output_stationary' needs shard_over='context_parallel' (it shards"
                             " linear inputs over the context-parallel group); use 'input_stationary' with 'all'.")
        if self.per_sample not in PER_SAMPLE_METHODS:
            raise ValueError(f"per_sample={self.per_sample!r}; choose one of {PER_SAMPLE_METHODS}.")
        if self.context_parallel_size is not None and self.context_parallel_size < 1:
            raise ValueError(f"context_parallel_size must be >= 1 or None, got {self.context_parallel_size}.")
        if self.grad_sample_pattern not in GRAD_SAMPLE_PATTERNS:
            raise ValueError(
                f"grad_sample_pattern={self.grad_sample_pattern!r}; choose one of {GRAD_SAMPLE_PATTERNS}."
            )
        if self.communication_bucket_mb < 0:
            raise ValueError(f"communication_bucket_mb must be >= 0, got {self.communication_bucket_mb}.")
        select_blocks([], self.activation_checkpointing)  # validates the policy's type and value
        check_clipping(self.clipping, self.per_layer_thresholds, self.per_sample, self.per_layer_kernel)
        check_norm_estimator(self.norm_estimator, self.projection_dim, self.per_sample, self.clipping)

    @property
    def output_stationary(self) -> bool:
        return self.grad_sample_pattern == "output_stationary"


def parallelize(
    module: nn.Module,
    parallelism: DPParallelism,
    context_parallel_mesh: DeviceMesh,
    device: torch.device,
    precision: object = "32-true",
    sharding_mesh: Optional[DeviceMesh] = None,
) -> LocalExchange:
    """Prepare ``module`` for DP training on its context-parallel group; returns the exchange for its layout.

    The same steps at every group size: activation checkpointing (DP-safe, LongShield-V3); attention that
    all-gathers K/V over the group (the model's own attention on one rank); FSDP2 sharding (`shard_with_fsdp`, with
    the precision's `gather_policy`) over the group, or over ``sharding_mesh`` (``shard_over="all"``: every rank, in
    rank order, as TorchTitan's ``dp_shard_cp``; `build_all_ranks_mesh`); the materialisation of a meta-device model
    shard by shard on ``device``; and the exchange that completes per-sample gradients over the group (V1 / V2, or
    local when the group is one rank). Where that mesh is one rank, FSDP2 is not applied: its all-gathers and
    reduce-scatters over one rank are copies, and AdamW over its DTensors pays the tensor subclass's dispatch (about
    0.15 of a tiny MBS-1 step on CPU); the parameters stay plain tensors, the local exchange takes ``.grad`` and the
    per-sample gradients as they are, as on a sharded layout's one-rank view.
    """
    if parallelism.activation_checkpointing is not False:
        apply_activation_checkpointing(module, parallelism.activation_checkpointing)
    group = context_parallel_mesh.get_group()
    if context_parallel_mesh.size() > 1:
        apply_context_parallel_attention(module, group)
    fsdp_mesh = sharding_mesh if sharding_mesh is not None else context_parallel_mesh
    replicas = fsdp_mesh.size() // context_parallel_mesh.size()
    fsdp_shards: dict[str, ParamShard] = {}
    if fsdp_mesh.size() > 1:
        fsdp_shards = shard_with_fsdp(module, fsdp_mesh, parallelism.output_stationary,
                                      mp_policy=gather_policy(precision))
    materialize_meta_parameters(module, device, fsdp_mesh.get_local_rank())
    cp_rank, cp_size = context_parallel_mesh.get_local_rank(), context_parallel_mesh.size()
    shards = {name: ParamShard(shard.dim, cp_rank, cp_size, shard.size, replicas)
              for name, shard in fsdp_shards.items()}
    return build_exchange(
        group,
        shards,
        shard_per_sample_grads=parallelism.shard_per_sample_grads,
        output_stationary=parallelism.output_stationary,
        overlap=parallelism.overlap_communication,
        bucket_bytes=int(parallelism.communication_bucket_mb * 2**20),
    )


def shard_with_fsdp(
    module: nn.Module,
    mesh: DeviceMesh,
    shard_linear_inputs: bool = False,
    mp_policy: Optional[MixedPrecisionPolicy] = None,
) -> dict[str, ParamShard]:
    """Shard ``module``'s parameters over the 1-D ``mesh``: every block of every `nn.ModuleList`, then each child.

    Gradients are reduce-scattered as plain sums (FSDP2 would otherwise average over the group, but a shard's
    per-sample gradient is the *sum* of the ranks' token partials). With ``shard_linear_inputs`` a linear weight
    with more input than output features is sharded along its input dimension (the output-stationary pattern
    all-to-alls the larger of activation and output gradient, and the shard dimension follows it).
    Returns the shard every trainable parameter has on this rank, by parameter name.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    input_sharded = set()
    if shard_linear_inputs:
        input_sharded = {
            id(m.weight) for m in module.modules() if type(m) is nn.Linear and m.in_features > m.out_features
        }

    def placement(param: nn.Parameter) -> Shard:
        return Shard(1) if id(param) in input_sharded else Shard(0)

    for list_module in [m for m in module.modules() if isinstance(m, nn.ModuleList)]:
        for block in list_module:
            fully_shard(block, mesh=mesh, shard_placement_fn=placement, mp_policy=mp_policy)
    if any(p.requires_grad for p in module.parameters(recurse=False)):
        raise TypeError(f"{type(module).__name__} owns parameters directly; put them in a submodule to shard it.")
    for child in module.children():
        if any(True for _ in child.parameters()) and not isinstance(child, FSDPModule):
            fully_shard(child, mesh=mesh, shard_placement_fn=placement, mp_policy=mp_policy)
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.set_gradient_divide_factor(1.0)
            submodule.set_force_sum_reduction_for_comms(True)
    rank, world = mesh.get_local_rank(), mesh.size()
    shards = {}
    for name, param in module.named_parameters():
        dim = param.placements[0].dim
        shards[name] = ParamShard(dim=dim, rank=rank, world=world, size=param.shape[dim])
    return shards


def gather_policy(precision: object) -> Optional[MixedPrecisionPolicy]:
    """FSDP2's policy for a Lightning precision: bf16-mixed gathers parameters in bf16, the rest as stored.

    bf16-mixed keeps fp32 shards, optimizer state and gradient reductions, as TorchTitan does, and gathers bf16.

    Under autocast alone every linear layer would save its own bf16 copy of the gathered fp32 weight for backward,
    keeping a bf16 copy of the whole model alive until backward; a bf16 gather is freed after each block's forward
    and gathered again for its backward. Forward inputs are not cast: the RoPE angles must stay fp32.
    """
    if precision != "bf16-mixed":
        return None
    return MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32, cast_forward_inputs=False)


def materialize_meta_parameters(module: nn.Module, device: torch.device, rank: int) -> bool:
    """Allocate a meta-device module's (FSDP2-sharded) parameters on ``device`` and initialise them, each rank only
    its own shards, with the model's ``init_weights`` (LoRA adapters as PEFT initialises them). Returns whether
    there was anything to materialise.

    The initial distribution is the model's own; the draws come from a generator seeded by a hash of one draw of
    the global RNG and ``rank``, so a run seeded the same way on the same layout is reproducible and the ranks'
    shards are independent (on CPU, DTensor random ops would otherwise draw the same values on every rank).
    """
    if not any(p.is_meta for p in module.parameters()):
        return False
    initializers = [m for m in module.modules() if callable(getattr(m, "init_weights", None))]
    if not initializers:
        raise TypeError(
            f"{type(module).__name__} was built on the meta device (context parallelism allocates only each rank's"
            " shards) but no submodule has an init_weights() method to initialise them. Add one, or build the model"
            " before fit (e.g. call configure_model() yourself)."
        )
    module.to_empty(device=device)
    base = int(torch.randint(2**62, (1,)).item())
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
        seed = derive_seed(base, "init", rank)
        torch.manual_seed(seed)
        for initializer in initializers:
            initializer.init_weights()
        reset_adapters(module)
    return True
