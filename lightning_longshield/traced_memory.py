"""Traced memory: one real DP step of `LongShieldStrategy` + `CausalLMModule` on fake tensors, for rank 0.

Nothing of the model's size is allocated: parameters, activations and gradients are ``FakeTensor``s (shapes and
dtypes only), and a fake process group stands in for the other ranks of the ``(data_parallel, context_parallel)``
mesh, so every collective returns at once with correctly shaped results. The strategy's own code runs unchanged:
FSDP2 sharding over the CP group, head-tail sequence sharding, CP attention, per-sample-gradient capture and
exchange (V1 all-reduce, V2 reduce-scatter), flat clipping, the clipped-sum accumulator, noise and the AdamW step.
`torch.distributed._tools.mem_tracker.MemTracker` records, storage by storage, what is alive, and the peak is
reported by category.

The non-private methods (``nondp-cp``, ``nondp-cp-ac``) run the same model with the same CP attention, FSDP2
sharding and checkpointing, but plain autograd and AdamW instead of the DP engine. ``zero-dp`` is the strategy's
ZeRO-DP+ (CP 1, ``shard_over="all"`` over the ``data_parallel`` fake ranks, ``norms="mixed"``).
``nondp-fsdp`` is not LongShield's code path and is not traced.

The DP engine's tensors are labelled through its public observer interface (`DPStepObserver`). The analytic
planner (``simulate``, torch-free) never imports this module; ``longshield-plan trace`` finds it as a plug-in.
"""

from __future__ import annotations

import argparse
import logging
import math
import time
import warnings
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist
from lightning.fabric.plugins.environments import LightningEnvironment
from rich.console import Console
from rich.table import Table
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed._tools.mem_tracker import MemTracker, _RefType
from torch.testing._internal.distributed.fake_pg import FakeStore
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from lightning_longshield.privacy.observer import DPStepObserver
from simulate.config import CLIPPINGS, METHODS, TRACEABLE_METHODS, MethodSpec, longshield_config, make_config
from simulate.memory import estimate_memory

TRACE_PRECISIONS = {"bf16-mixed": "bf16-mixed", "fp32": "32-true"}
CATEGORIES = ("parameters", "gradients", "optimizer_state", "activations", "per_sample_grads", "temporaries")


class _TraceRef(_RefType):
    """MemTracker's categories plus LongShield's own: per-sample gradients and the clipped-sum accumulator."""

    PARAM = "Parameter"
    BUFFER = "Buffer"
    GRAD = "Gradient"
    ACT = "Activation"
    TEMP = "Temp"
    OPT = "Optstate"
    OTH = "Other"
    PER_SAMPLE = "Per-sample gradient"
    ACCUMULATOR = "DP accumulator"


# Tracker category -> reported category. Buffers and "other" are tiny here (no model buffers; RoPE is recomputed).
_REPORTED = {
    _TraceRef.PARAM: "parameters",
    _TraceRef.BUFFER: "parameters",
    _TraceRef.GRAD: "gradients",
    _TraceRef.ACCUMULATOR: "gradients",
    _TraceRef.OPT: "optimizer_state",
    _TraceRef.ACT: "activations",
    _TraceRef.PER_SAMPLE: "per_sample_grads",
    _TraceRef.TEMP: "temporaries",
    _TraceRef.OTH: "temporaries",
}


class _DPMemTracker(MemTracker):
    """A `MemTracker` that can re-label tensors as per-sample gradients or as the DP accumulator."""

    def __init__(self) -> None:
        super().__init__()
        self._ref_class = _TraceRef
        self.per_sample_peak = 0

    def _update_peak_stats(self, peak_state: object) -> None:
        # Only the whole step's peak is read. MemTracker also keeps every module's peak, walking all modules at every
        # op: most of a full-size trace's time, and not needed here.
        modules, self.memory_tracking = self.memory_tracking, {}  # type: ignore[assignment]
        try:
            super()._update_peak_stats(peak_state)  # type: ignore[arg-type]
        finally:
            self.memory_tracking = modules

    def relabel(self, tensor: torch.Tensor, category: _TraceRef) -> None:
        self._update_and_maybe_create_winfos(tensor, category)
        if category is _TraceRef.PER_SAMPLE:
            self.per_sample_peak = max(self.per_sample_peak, _current(self).get(_TraceRef.PER_SAMPLE, 0))


@dataclass(frozen=True)
class TraceResult:
    """Rank 0's peak memory during one traced step, in bytes by category (``total`` is their sum).

    ``at_start`` is what was alive when the step began (parameters, AdamW's moments), so ``total - at_start`` is
    what the step itself adds; ``per_sample_grads_peak`` is the most per-sample gradient memory held at any time
    (at the step's overall peak it may be none). ``attention_largest_tensor`` is the shape of the largest tensor any
    attention module's forward creates (a ``T_local x T`` mask or score matrix would show here).
    """

    model: str
    method: str
    cp: int
    data_parallel: int
    mbs: int
    seq_len: int
    precision: str
    parameters: int
    gradients: int
    optimizer_state: int
    activations: int
    per_sample_grads: int
    temporaries: int
    at_start: int
    per_sample_grads_peak: int
    attention_largest_tensor: tuple[int, ...]
    seconds: float

    @property
    def total(self) -> int:
        return sum(getattr(self, name) for name in CATEGORIES)

    def as_gib(self) -> dict[str, float]:
        return {name: getattr(self, name) / 2**30 for name in (*CATEGORIES, "total")}

    def to_dict(self) -> dict[str, object]:
        out = asdict(self)
        out["total"] = self.total
        out["peak_memory_gib"] = round(self.total / 2**30, 3)
        out["breakdown_gib"] = {name: round(value, 3) for name, value in self.as_gib().items() if name != "total"}
        return out


def trace_step(
    model: str = "llama3.1-8b",
    method: str = "v2",
    cp: int = 4,
    data_parallel: int = 1,
    mbs: int = 1,
    seq_len: int = 16384,
    precision: str = "bf16-mixed",
    clipping: str = "flat",
) -> TraceResult:
    """Trace one DP step (a logical batch of two micro-batches) of rank 0 and return its peak memory by category.

    ``method`` is one of `TRACEABLE_METHODS` (``v3`` / ``nondp-cp-ac`` checkpoint every block; ``zero-dp`` runs
    at CP 1 with model states sharded over all ranks; ``clipping`` is ``"flat"`` or ``"per_layer"``);
    the world is ``data_parallel x cp`` fake ranks. Takes seconds
    (about 10 for 8B at T 16k, CP 4, on 2 CPU cores) and allocates no tensor of the model's size. Must not run inside an
    initialised (real) process group.
    """
    _validate(model, method, cp, data_parallel, mbs, seq_len, precision, clipping)
    if dist.is_initialized():
        raise RuntimeError("trace_step creates its own fake process group; call it outside a distributed run.")
    start = time.perf_counter()
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=cp * data_parallel)
    lightning_log = logging.getLogger("lightning.pytorch")
    level = lightning_log.level
    lightning_log.setLevel(logging.WARNING)  # the Trainer's banner
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            peak = _traced_peak(model, METHODS[method], cp, mbs, seq_len, TRACE_PRECISIONS[precision],
                                clipping)
    finally:
        lightning_log.setLevel(level)
        dist.destroy_process_group()
    return TraceResult(model, method, cp, data_parallel, mbs, seq_len, precision, **peak,
                       seconds=round(time.perf_counter() - start, 2))


def _validate(model: str, method: str, cp: int, data_parallel: int, mbs: int, seq_len: int, precision: str,
              clipping: str) -> None:
    if method not in TRACEABLE_METHODS:
        raise ValueError(f"Method {method!r} cannot be traced (it is not LongShield's code path); choose one of"
                         f" {list(TRACEABLE_METHODS)}.")
    if precision not in TRACE_PRECISIONS:
        raise ValueError(f"Precision {precision!r} cannot be traced; choose one of {list(TRACE_PRECISIONS)}.")
    if data_parallel < 1:
        raise ValueError(f"Data-parallel size must be >= 1, got {data_parallel}.")
    # The analytic planner's validation: model name, MBS, sequence length divisible by 2 x CP.
    make_config(model=model, gpus=cp * data_parallel, method=method, mbs=mbs, seq_len=seq_len, cp=cp,
                precision=precision, clipping=clipping)


def _traced_peak(model: str, method: MethodSpec, cp: int, mbs: int, seq_len: int, precision: str,
                 clipping: str) -> dict[str, int]:
    import lightning.pytorch as pl
    from lightning.pytorch.trainer import call
    from lightning.pytorch.trainer.states import RunningStage, TrainerFn

    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from lightning_longshield.batching import split_into_microbatches
    from lightning_longshield.models import LlamaConfig
    from lightning_longshield.privacy.plan import PrivacyPlan

    world = dist.get_world_size()
    layout = make_config(model=model, gpus=world, method=method, mbs=mbs, seq_len=seq_len, cp=cp,
                         clipping=clipping, per_layer_kernel="torch").strategy  # as the strategy runs this method
    strategy = LongShieldStrategy(
        noise_multiplier=1.0, poisson_sampling=False, seed=0, cluster_environment=_FakeRankZero(world),
        **{name: getattr(layout, name) for name in layout.as_arguments()},
    )
    trainer = pl.Trainer(strategy=strategy, accelerator="cpu", devices=1, precision=precision, logger=False,
                         enable_progress_bar=False, enable_checkpointing=False, enable_model_summary=False)
    module = CausalLMModule(LlamaConfig.from_name(model), optimizer="adamw")
    strategy.connect(module)
    module.trainer = trainer
    trainer.state.fn, trainer.state.stage = TrainerFn.FITTING, RunningStage.TRAINING
    strategy.setup_environment()  # the (fake) device mesh, outside fake mode: DeviceMesh reads rank lists

    with FakeTensorMode(allow_non_fake_inputs=True):
        _build_fake_model(module)
        if method.private:
            strategy.setup(trainer)
            optimizer = strategy.optimizers[0]
            strategy.privacy.plan = PrivacyPlan(1.0, 1e-6, 0.01, mbs, 100 * mbs, 1, None)
        else:
            optimizer = _setup_non_private(strategy, module)
        _initialise_optimizer_state(optimizer)
        # Two micro-batches: the second runs with the first one's clipped sum (or gradient) alive, as every
        # micro-batch but the first of a logical batch does.
        batch = {"input_ids": torch.zeros(2 * mbs, seq_len, dtype=torch.long),
                 "labels": torch.zeros(2 * mbs, seq_len, dtype=torch.long)}
        tracker = _DPMemTracker()
        tracker.track_external(module, optimizer)
        at_start = sum(_current(tracker).values())
        attention_tensors = _LargestTensorIn(_attention_modules(module))
        with tracker, attention_tensors:
            if method.private:
                strategy.dp_engine.observe(_LabellingObserver(tracker))
                loss = call._call_strategy_hook(trainer, "training_step", batch, 0)
                strategy.backward(loss, optimizer)
                # The closure ran above, outside the optimizer step, so its tensors are not labelled as
                # optimizer state; the release (noise) and AdamW run inside the step, as in Lightning.
                strategy.optimizer_step(optimizer, _ignore)
            else:
                for microbatch in split_into_microbatches(batch, mbs):
                    tracker.reset_mod_stats()
                    with trainer.precision_plugin.forward_context():
                        loss = module.training_step(strategy._shard_sequence(microbatch), 0)
                    loss.backward()
                optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        snapshot = next(iter(tracker.get_tracker_snapshot("peak").values()))
    peak = dict.fromkeys(CATEGORIES, 0)
    for category, reported in _REPORTED.items():
        peak[reported] += snapshot.get(category, 0)
    attention_tensors.remove_hooks()
    return {**peak, "at_start": at_start, "per_sample_grads_peak": tracker.per_sample_peak,
            "attention_largest_tensor": attention_tensors.largest}


def _attention_modules(module: nn.Module) -> list[nn.Module]:
    return [submodule for submodule in module.modules() if hasattr(submodule, "attention_fn")]


class _LargestTensorIn(TorchDispatchMode):
    """Records the shape of the largest tensor that any op creates while one of ``modules`` runs its forward."""

    def __init__(self, modules: list[nn.Module]) -> None:
        super().__init__()
        self.largest: tuple[int, ...] = ()
        self._inside = 0
        self._handles = [handle for m in modules for handle in (
            m.register_forward_pre_hook(self._enter), m.register_forward_hook(self._leave))]

    def _enter(self, *args: object) -> None:
        self._inside += 1

    def _leave(self, *args: object) -> None:
        self._inside -= 1

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # type: ignore[no-untyped-def]
        out = func(*args, **(kwargs or {}))
        if self._inside:
            for tensor in tree_leaves(out):
                if isinstance(tensor, torch.Tensor) and tensor.numel() > _numel(self.largest):
                    self.largest = tuple(tensor.shape)
        return out


def _numel(shape: tuple[int, ...]) -> int:
    return math.prod(shape) if shape else 0


class _FakeRankZero(LightningEnvironment):
    """Rank 0 of a world of fake ranks (the fake process group is already initialised)."""

    def __init__(self, world_size: int) -> None:
        super().__init__()
        self._world = world_size

    def world_size(self) -> int:
        return self._world

    def global_rank(self) -> int:
        return 0


def _current(tracker: MemTracker) -> dict[_RefType, int]:
    """Bytes alive now by category (one device: the fake CPU), without the total."""
    snapshot = next(iter(tracker.get_tracker_snapshot("current").values()), {})
    return {category: value for category, value in snapshot.items() if isinstance(category, _RefType)}


def _ignore(*args: object, **kwargs: object) -> None:
    return None


def _build_fake_model(module: nn.Module) -> None:
    """``configure_model`` on the meta device, then fake CPU parameters (tied parameters stay tied).

    Initialisation is skipped: it reads values (truncated normal), which fake tensors do not have.
    """
    with torch.device("meta"):
        module.configure_model()
    fakes: dict[int, nn.Parameter] = {}
    for submodule in module.modules():
        for name, param in list(submodule._parameters.items()):
            if param is None:
                continue
            if id(param) not in fakes:
                fake = torch.empty_like(param, device="cpu")
                fakes[id(param)] = nn.Parameter(fake, requires_grad=param.requires_grad)
            submodule._parameters[name] = fakes[id(param)]


def _setup_non_private(strategy, module: nn.Module) -> torch.optim.Optimizer:
    """The strategy's parallelisation (checkpointing, CP attention, FSDP2) without the DP engine."""
    from lightning_longshield.parallelize import parallelize

    mesh, precision = strategy.context_parallel_mesh, strategy.precision_plugin.precision
    parallelize(module, strategy.config, mesh, strategy.root_device, precision)
    return module.configure_optimizers()


def _initialise_optimizer_state(optimizer: torch.optim.Optimizer) -> None:
    """One step on zero gradients creates AdamW's moments, so the traced step is a steady-state one."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for param in params:
        param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


class _LabellingObserver(DPStepObserver):
    """Labels what the DP engine holds: per-sample gradients (exchange) and clipped sums (accumulator).

    Also forgets the tracker's per-module statistics before each micro-batch (MemTracker refuses a second forward
    of the root module otherwise); the peak it keeps is global.
    """

    def __init__(self, tracker: _DPMemTracker) -> None:
        self.tracker = tracker

    def microbatch_started(self) -> None:
        self.tracker.reset_mod_stats()

    def per_sample_gradient(self, grad_sample: torch.Tensor) -> None:
        self.tracker.relabel(grad_sample, _TraceRef.PER_SAMPLE)

    def microbatch_gradients(self, grad_samples: Iterable[torch.Tensor]) -> None:
        for grad in grad_samples:  # micro-batch of one: the sample's gradient is the .grad (shard)
            self.tracker.relabel(grad, _TraceRef.PER_SAMPLE)

    def clipped_sums(self, sums: Iterable[torch.Tensor]) -> None:
        for total in sums:
            self.tracker.relabel(total, _TraceRef.ACCUMULATOR)


# --- `longshield-plan trace`: registered as a plug-in of the planner's CLI (entry point "longshield_plan.commands")

def register_trace_command(add_command: Callable[..., argparse.ArgumentParser]) -> None:
    """Add ``trace`` to ``longshield-plan`` (``add_command`` is `simulate.cli.add_command` bound to its subparsers)."""
    from simulate.cli import positive_int, power_of_two

    trace = add_command("trace", _trace_command, "peak memory of rank 0 in one real DP step, traced on fake tensors",
                        precisions=tuple(TRACE_PRECISIONS), hardware=False)
    trace.add_argument("--method", choices=list(TRACEABLE_METHODS), default="v2", help="method to trace")
    trace.add_argument("--cp", type=positive_int, default=None,
                       help="context-parallel size (default: 4, or 1 for a method without context parallelism)")
    trace.add_argument("--data-parallel", type=positive_int, default=1, help="data-parallel groups")
    trace.add_argument("--mbs", type=positive_int, default=1, help="micro-batch size")
    trace.add_argument("--seq-len", type=power_of_two, required=True, help="sequence length, a power of two")
    trace.add_argument("--clipping", choices=list(CLIPPINGS), default="flat", help="flat or per_layer clipping")


def _trace_command(args: argparse.Namespace, console: Console) -> dict[str, object]:
    from simulate.config import METHODS

    if args.cp is None:
        args.cp = 4 if METHODS[args.method].context_parallel else 1
    if not args.json:
        console.print(f"Tracing one DP step of rank 0 on fake tensors ({args.model}, {args.method}, CP {args.cp},"
                      f" data-parallel {args.data_parallel}, MBS {args.mbs}, T {args.seq_len}) ...")
    result = trace_step(model=args.model, method=args.method, cp=args.cp, data_parallel=args.data_parallel,
                        mbs=args.mbs, seq_len=args.seq_len, precision=args.precision, clipping=args.clipping)
    analytic = estimate_memory(longshield_config(args.model, args.method, args.cp, args.mbs, args.seq_len,
                                                 args.precision, data_parallel=args.data_parallel,
                                                 clipping=args.clipping, per_layer_kernel="torch"))  # as traced
    out = result.to_dict()
    out["analytic_allocated_gib"] = round(analytic.allocated / 2**30, 3)
    out["analytic_vs_traced"] = round(analytic.allocated / result.total - 1, 4)
    if not args.json:
        table = Table(title=f"Traced peak of rank 0: {out['peak_memory_gib']:.2f} GiB ({result.seconds:.0f} s)")
        table.add_column("category")
        table.add_column("GiB", justify="right")
        for name, gib in out["breakdown_gib"].items():
            table.add_row(name.replace("_", " "), f"{gib:.2f}")
        console.print(table)
        console.print(f"Analytic allocated peak: {out['analytic_allocated_gib']:.2f} GiB "
                      f"({100 * out['analytic_vs_traced']:+.1f}% vs traced)")
        console.print(f"Largest tensor created in attention: {tuple(result.attention_largest_tensor)}")
    return out
