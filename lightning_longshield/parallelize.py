"""Parallelism applied from outside the model: activation checkpointing, CP attention and FSDP2 over the CP group."""

from __future__ import annotations

import math
import warnings
from collections.abc import Callable
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from lightning_longshield.activation_checkpointing import apply_activation_checkpointing
from lightning_longshield.context_parallel import apply_context_parallel_attention
from lightning_longshield.privacy.grad_sample.exchange import LocalExchange, build_exchange
from lightning_longshield.privacy.randomness import derive_seed
from lightning_longshield.privacy.shards import ParamShard
from simulate.strategy_config import StrategyConfig


def parallelize(
    module: nn.Module,
    config: StrategyConfig,
    context_parallel_mesh: DeviceMesh,
    device: torch.device,
    precision: object = "32-true",
    sharding_mesh: Optional[DeviceMesh] = None,
    initialize: Optional[Callable[[], None]] = None,
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
    per-sample gradients as they are, as on a sharded layout's one-rank view. ``initialize`` runs after the
    model's ``init_weights`` on a materialised model (for what the model does not own, e.g. adapters).
    """
    if config.activation_checkpointing is not False:
        apply_activation_checkpointing(module, config.activation_checkpointing)
    group = context_parallel_mesh.get_group()
    if context_parallel_mesh.size() > 1:
        apply_context_parallel_attention(module, group)
    fsdp_mesh = sharding_mesh if sharding_mesh is not None else context_parallel_mesh
    replicas = fsdp_mesh.size() // context_parallel_mesh.size()
    fsdp_shards: dict[str, ParamShard] = {}
    if fsdp_mesh.size() > 1:
        fsdp_shards = shard_with_fsdp(module, fsdp_mesh, config.output_stationary,
                                      mp_policy=gather_policy(precision))
    materialize_meta_parameters(module, device, fsdp_mesh.get_local_rank(), initialize,
                                group=fsdp_mesh.get_group() if fsdp_mesh.size() > 1 else None)
    cp_rank, cp_size = context_parallel_mesh.get_local_rank(), context_parallel_mesh.size()
    shards = {name: ParamShard(shard.dim, cp_rank, cp_size, shard.size, replicas)
              for name, shard in fsdp_shards.items()}
    return build_exchange(
        group,
        shards,
        exchange=config.exchange,
        overlap=config.overlap_communication,
        bucket_bytes=int(config.communication_bucket_mb * 2**20),
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
    all-to-alls the larger of activation and output gradient, and the shard dimension follows it) where the mesh
    splits that dimension evenly (FSDP2 shards dimension 1 only evenly); elsewhere along its output dimension, which
    the exchange handles too.
    Returns the shard every trainable parameter has on this rank, by parameter name.
    """
    mp_policy = mp_policy or MixedPrecisionPolicy()
    input_sharded = {id(w) for w in input_sharded_weights(module, mesh.size())} if shard_linear_inputs else set()

    def placement(param: nn.Parameter) -> Shard:
        return Shard(1) if id(param) in input_sharded else Shard(0)

    # The innermost lists first (a block's experts before the blocks): FSDP2 shards a module's submodules before it.
    for list_module in reversed([m for m in module.modules() if isinstance(m, nn.ModuleList)]):
        for block in list_module:
            # Sharded already (an earlier fit of this module), or a list itself (stages of blocks), never called.
            if not isinstance(block, (FSDPModule, nn.ModuleList)):
                fully_shard(block, mesh=mesh, shard_placement_fn=placement, mp_policy=mp_policy)
    if any(p.requires_grad for p in module.parameters(recurse=False)):
        raise TypeError(f"{type(module).__name__} owns parameters directly; put them in a submodule to shard it.")
    for child in module.children():
        if any(True for _ in child.parameters()) and not isinstance(child, FSDPModule):
            fully_shard(child, mesh=mesh, shard_placement_fn=placement, mp_policy=mp_policy)
    for submodule in module.modules():
        if isinstance(submodule, FSDPModule):
            submodule.reshard()  # an evaluation since an earlier fit left the root's parameters gathered
            submodule.set_gradient_divide_factor(1.0)
            submodule.set_force_sum_reduction_for_comms(True)
    rank, world = mesh.get_local_rank(), mesh.size()
    shards = {}
    for name, param in module.named_parameters():
        if not hasattr(param, "placements"):  # a frozen parameter of the root itself: not sharded, not clipped
            continue
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


def _tied_parameter_owners(module: nn.Module) -> list[list[tuple[nn.Module, str]]]:
    """The (module, attribute) pairs of every parameter that more than one module owns (tied weights)."""
    owners: dict[int, dict[tuple[int, str], tuple[nn.Module, str]]] = {}
    for submodule in module.modules():
        for name, param in submodule.named_parameters(recurse=False):
            owners.setdefault(id(param), {})[(id(submodule), name)] = (submodule, name)
    return [list(group.values()) for group in owners.values() if len(group) > 1]


def materialize_meta_parameters(
    module: nn.Module, device: torch.device, rank: int, initialize: Optional[Callable[[], None]] = None,
    group: Optional[dist.ProcessGroup] = None,
) -> bool:
    """Allocate a meta-device module's (FSDP2-sharded) parameters on ``device`` and initialise them, each rank only
    its own shards, with the model's ``init_weights`` and then ``initialize`` (e.g. the LightningModule's LoRA
    adapters, as PEFT initialises them). Returns whether there was anything to materialise.

    Every floating-point parameter and buffer materialised here must be set by those: a buffer computed in the
    model's ``__init__`` (a rotary ``inv_freq``) was computed on the meta device, into nothing. Such a tensor is
    refused by name (`_refuse_unset`, agreed over ``group``, the ranks sharing the shards) instead of training on
    whatever its memory held.

    The initial distribution is the model's own; the draws come from a generator seeded by a hash of one draw of
    the global RNG and ``rank``, so a run seeded the same way on the same layout is reproducible and the ranks'
    shards are independent (on CPU, DTensor random ops would otherwise draw the same values on every rank). What
    FSDP2 leaves whole (buffers, frozen parameters outside its units) is then rank 0's on every rank of ``group``.
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
    tied = _tied_parameter_owners(module)
    unset = [name for name, tensor in _named_tensors(module) if tensor.is_meta and tensor.is_floating_point()]
    # Only the meta tensors: `to_empty` would also empty every real tensor, e.g. a LightningModule's metric states.
    module._apply(lambda tensor: torch.empty_like(tensor, device=device) if tensor.is_meta else tensor)
    for owners in tied:  # each owner of a plain meta tensor gets its own copy: tie them again
        kept = getattr(*owners[0])
        for owner, name in owners[1:]:
            if getattr(owner, name) is not kept:  # a sharded tie (FSDP2's DTensors) survives this
                setattr(owner, name, kept)
    tensors = dict(_named_tensors(module))
    for name in unset:
        _local(tensors[name]).fill_(math.nan)  # what init_weights leaves unset stays NaN
    base = int(torch.randint(2**62, (1,)).item())
    devices = [device] if device.type == "cuda" else []
    with torch.random.fork_rng(devices=devices, device_type=device.type), warnings.catch_warnings():
        warnings.filterwarnings("ignore", "DTensor random operators may not have complete support")
        seed = derive_seed(base, "init", rank)
        torch.manual_seed(seed)
        for initializer in initializers:
            initializer.init_weights()
        if initialize is not None:
            initialize()
    _refuse_unset(module, unset, group)
    _broadcast_whole_tensors(module, group)  # each rank drew them with its own seed
    return True


@torch.no_grad()
def sync_data_parallel_replicas(module: nn.Module, group: Optional[dist.ProcessGroup],
                                sharded_over_all: bool = False) -> None:
    """Give every replica in ``group`` (the data-parallel group) its rank 0's parameters and buffers, each rank its
    local shards, as DDP does when it wraps a model: replicas built apart (an unseeded initialisation in each
    process) would otherwise train different models from one released gradient. With ``sharded_over_all`` (FSDP2
    over every rank, ``shard_over="all"``: its parameters are each rank's own shards, not replicas) only the tensors
    FSDP2 leaves whole, buffers and unsharded frozen parameters."""
    if sharded_over_all:
        _broadcast_whole_tensors(module, group)
        return
    if group is None or dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    for _, tensor in _named_tensors(module):
        dist.broadcast(_local(tensor), src=source, group=group)


def _broadcast_whole_tensors(module: nn.Module, group: Optional[dist.ProcessGroup]) -> None:
    """Give every rank of ``group`` its rank 0's copy of the tensors FSDP2 leaves whole (buffers, unsharded frozen
    parameters): the ranks that share a model's shards must hold one value of each of them."""
    if group is None or dist.get_world_size(group) == 1:
        return
    source = dist.get_global_rank(group, 0)
    for _, tensor in _named_tensors(module):
        if not isinstance(tensor, DTensor):
            dist.broadcast(tensor.detach(), src=source, group=group)


def _named_tensors(module: nn.Module) -> list[tuple[str, torch.Tensor]]:
    return [*module.named_parameters(), *module.named_buffers()]


def _local(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's part of a tensor (a DTensor's local shard), without autograd."""
    return (tensor.to_local() if hasattr(tensor, "to_local") else tensor).detach()


def _refuse_unset(module: nn.Module, names: list[str], group: Optional[dist.ProcessGroup]) -> None:
    """Raise, on every rank alike, if a tensor of ``names`` still holds the NaN it was materialised with."""
    if not names:
        return
    tensors = dict(_named_tensors(module))
    unset = torch.tensor([bool(_local(tensors[name]).isnan().any()) for name in names], dtype=torch.int32)
    if group is not None:
        dist.all_reduce(unset, op=dist.ReduceOp.MAX, group=group)
    missing = [name for name, flag in zip(names, unset.tolist()) if flag]
    if missing:
        raise RuntimeError(
            f"{type(module).__name__} was built on the meta device (context parallelism allocates only each rank's"
            f" shards), and init_weights() left {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} unset:"
            " a tensor computed in __init__ was computed on the meta device, into nothing. Set every parameter and"
            " buffer in init_weights() (e.g. recompute a rotary inv_freq there), or build the model before fit."
        )


def input_sharded_weights(module: nn.Module, world_size: int) -> list[nn.Parameter]:
    """The linear weights the output-stationary layout shards along their input features over ``world_size`` ranks:
    more input than output features, split evenly (FSDP2 shards dimension 1 only evenly; the others shard along their
    output features, which the exchange handles too)."""
    return [m.weight for m in module.modules()
            if type(m) is nn.Linear and m.in_features > m.out_features and m.in_features % world_size == 0]
