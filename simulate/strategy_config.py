"""`StrategyConfig`: how a DP run is laid out and clipped, in the words of `LongShieldStrategy`'s arguments.

Torch-free, so that the strategy (which builds one from its arguments) and the planner (which plans one) share the
same description and the same rules. Every rule about which choices go together lives here, in
`StrategyConfig.__post_init__`: a combination is either valid or refused at construction with one message that names
the fix. Each choice is one argument; a choice that carries its own parameters is a small typed object
(`ProjectedNorms`, `PerLayerClipping`) whose plain-string form takes their defaults.
"""

from __future__ import annotations

import difflib
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, Union

#: How per-sample gradients are completed over a context-parallel group: ``"reduce_scatter"`` (LongShield-V2: each
#: rank keeps and clips 1/CP of every per-sample gradient), ``"all_reduce"`` (V1: every rank holds all of them) or
#: ``"output_stationary"`` (V2 that exchanges a linear layer's activations and output gradients instead).
EXCHANGES = ("reduce_scatter", "all_reduce", "output_stationary")
#: How linear and embedding weights get per-sample norms and clipped sums (exact): per-sample gradients, ghost norms
#: with book-keeping, or per weight the cheaper of the two.
EXACT_NORMS = ("materialize", "ghost", "mixed")
#: Randomized clipping (DP-SGD-RC): norms estimated from Gaussian projections (`ProjectedNorms`).
NORM_ESTIMATORS = ("hutchinson", "hutchpp")
CLIPPING_MODES = ("flat", "per_layer")
THRESHOLD_RULES = ("equal", "proportional")
#: Per-layer clipping of linear weights: the fused kernel where it runs (``"auto"``), always (``"triton"``) or never
#: (``"torch"``, the default; see `PerLayerClipping`).
PER_LAYER_KERNELS = ("auto", "triton", "torch")
SHARD_OVER = ("context_parallel", "all")
DEFAULT_PROJECTION_DIM = 32
DEFAULT_BUCKET_MB = 25.0

ThresholdSpec = Union[str, Mapping[str, float]]
#: ``True`` (every block), ``False``, ``k`` (every k-th block) or ``(index, block) -> bool``.
CheckpointPolicy = Union[bool, int, Callable[[int, Any], bool]]


@dataclass(frozen=True)
class ProjectedNorms:
    """Randomized clipping: each sample's squared norm over linear (and tied) weights estimated with
    ``projection_dim`` secret Gaussian projections per layer (``"hutchinson"``, or ``"hutchpp"``, which spends
    ``k // 3`` of them on a sketch of the head and accounts the rest). ``norms="hutchpp"`` is this with k = 32."""

    estimator: str = "hutchpp"
    projection_dim: int = DEFAULT_PROJECTION_DIM

    def __post_init__(self) -> None:
        if self.estimator not in NORM_ESTIMATORS:
            raise ValueError(f"ProjectedNorms(estimator={self.estimator!r}): choose one of {NORM_ESTIMATORS}.")
        k = self.projection_dim
        if isinstance(k, bool) or not isinstance(k, int) or k < 1:
            raise ValueError(f"ProjectedNorms(projection_dim={k!r}): a positive integer (e.g. 32).")
        if self.estimator == "hutchpp" and k < 3:
            raise ValueError(f"ProjectedNorms('hutchpp', projection_dim={k}): Hutch++ splits k into a head of k // 3"
                             " and a residual of k - k // 3 projections, so k >= 3; raise it or use 'hutchinson'.")


@dataclass(frozen=True)
class PerLayerClipping:
    """Per-layer clipping: each trainable parameter tensor clipped to its own bound ``C_l`` as its per-sample
    gradients complete in backward, with ``sum C_l^2 <= max_grad_norm^2`` (noise and accounting unchanged).

    ``thresholds``: ``"equal"`` (``C / sqrt(L)``), ``"proportional"`` (``C sqrt(n_l / sum n)``) or ``{name: C_l}``
    over every trainable parameter (names as in ``named_parameters()``). ``kernel``: linear weights through the fused
    kernel that never writes their per-sample gradients (``"auto"``: where it runs, CUDA with Triton and one rank per
    model; ``"triton"``: required) or through the PyTorch path (``"torch"``, the default), which forms one layer's
    per-sample gradients at a time and was faster on an H100 (the fused kernels' step 1.50x non-DP's at 1B, T 4096,
    micro-batch 2). ``clipping="per_layer"`` is this with its defaults.
    """

    thresholds: ThresholdSpec = "equal"
    kernel: str = "torch"

    def __post_init__(self) -> None:
        if self.kernel not in PER_LAYER_KERNELS:
            raise ValueError(f"PerLayerClipping(kernel={self.kernel!r}): choose one of {PER_LAYER_KERNELS}.")
        thresholds = self.thresholds
        if isinstance(thresholds, str):
            if thresholds not in THRESHOLD_RULES:
                raise ValueError(f"PerLayerClipping(thresholds={thresholds!r}): choose one of {THRESHOLD_RULES} or"
                                 " pass a mapping {parameter name: threshold}.")
        elif isinstance(thresholds, Mapping):
            bad = {name: c for name, c in thresholds.items()
                   if isinstance(c, bool) or not isinstance(c, (int, float)) or not 0 < c < math.inf}
            if bad:
                raise ValueError(f"Per-layer thresholds must be finite numbers > 0; got {bad}.")
        else:
            raise TypeError(f"PerLayerClipping(thresholds=...) must be one of {THRESHOLD_RULES} or a mapping"
                            f" {{parameter name: threshold}}, got {type(thresholds).__name__}.")


@dataclass(frozen=True)
class StrategyConfig:
    """The layout and clipping choices of one DP run: `LongShieldStrategy`'s arguments of the same names, validated
    together. ``norms`` and ``clipping`` take a string or their typed object and are stored as given; read them
    through the properties below.

    Args:
        context_parallel_size: processes per context-parallel group (``None``: all of them).
        micro_batch_size: samples per forward/backward (the memory knob; does not change the privacy).
        exchange: how per-sample gradients are completed over a CP group: ``"reduce_scatter"`` (LongShield-V2, each
            rank keeps 1/CP of each), ``"all_reduce"`` (V1) or ``"output_stationary"`` (V2 exchanging linear layers'
            activations and output gradients). One sample per micro-batch uses FSDP2's reduce-scatter either way.
        overlap_communication: overlap the per-sample reduce-scatter with the backward of the next layer.
        communication_bucket_mb: per-sample reduce-scatters in buckets of at least this size (``0``: per parameter).
        activation_checkpointing: DP-safe block-level activation checkpointing (LongShield-V3): ``True`` for every
            block, an int ``k`` for every k-th block, or a callable ``(index, block) -> bool``.
        norms: how linear and embedding weights get per-sample norms and clipped sums. ``"materialize"`` (default):
            per-sample gradients, the right choice for long sequences; ``"ghost"``: norms from ``T x T`` Gram matrices
            and book-keeping; ``"mixed"``: per weight the cheaper of the two. ``"hutchinson"`` / ``"hutchpp"`` or
            `ProjectedNorms`: randomized clipping (norms estimated from secret projections, accounted by its own
            accountant; slightly more noise for the same epsilon).
        clipping: ``"flat"`` (default: one bound over the whole gradient), or ``"per_layer"`` / `PerLayerClipping`:
            each parameter tensor clipped to its own ``C_l`` as its per-sample gradients complete, ``sum C_l^2 <=
            max_grad_norm^2`` (noise and accounting unchanged).
        shard_over: ``"context_parallel"`` (default): FSDP2 shards model states over each CP group. ``"all"``: over
            every rank (TorchTitan's ``dp_shard_cp``); data-parallel groups that drew fewer samples run zero-weight
            padding micro-batches. With CP 1 and ``norms="mixed"``: the paper's ZeRO-DP+ baseline.
    """

    context_parallel_size: Union[int, None] = None
    micro_batch_size: int = 1
    exchange: str = "reduce_scatter"
    overlap_communication: bool = True
    communication_bucket_mb: float = DEFAULT_BUCKET_MB
    activation_checkpointing: CheckpointPolicy = False
    norms: Union[str, ProjectedNorms] = "materialize"
    clipping: Union[str, PerLayerClipping] = "flat"
    shard_over: str = "context_parallel"
    _resolved: tuple[Union[str, ProjectedNorms], Union[str, PerLayerClipping]] = field(
        init=False, repr=False, compare=False, default=("materialize", "flat"))

    def __post_init__(self) -> None:
        cp = self.context_parallel_size
        if cp is not None and (isinstance(cp, bool) or not isinstance(cp, int) or cp < 1):
            raise ValueError(f"context_parallel_size must be a positive integer or None (all processes), got {cp!r}.")
        mbs = self.micro_batch_size
        if isinstance(mbs, bool) or not isinstance(mbs, int) or mbs < 1:
            raise ValueError(f"micro_batch_size must be an integer >= 1, got {mbs!r}.")
        _check_choice("exchange", self.exchange, EXCHANGES)
        _check_choice("shard_over", self.shard_over, SHARD_OVER)
        _check_bucket_mb(self.communication_bucket_mb)
        _check_checkpoint_policy(self.activation_checkpointing)
        norms = _resolve_norms(self.norms)
        clipping = _resolve_clipping(self.clipping)
        object.__setattr__(self, "_resolved", (norms, clipping))
        if self.shard_over == "all" and self.exchange == "output_stationary":
            raise ValueError("exchange='output_stationary' shards linear inputs over the context-parallel group, so it"
                             " needs shard_over='context_parallel'; use exchange='reduce_scatter' with 'all'.")
        if isinstance(clipping, PerLayerClipping) and norms != "materialize":
            raise ValueError(f"clipping='per_layer' clips each layer's per-sample gradients, but norms={self.norms!r}"
                             " never forms them; use norms='materialize' (the default) or clipping='flat'.")

    # ---------------------------------------------------------------- the choices, resolved

    @property
    def per_sample(self) -> str:
        """How linear and embedding weights are handled when norms are exact (``"materialize"`` under projected
        norms, whose book-keeping the estimator does itself)."""
        norms = self._resolved[0]
        return "materialize" if isinstance(norms, ProjectedNorms) else norms

    @property
    def projected_norms(self) -> Union[ProjectedNorms, None]:
        """The randomized estimator, or ``None`` for exact norms."""
        norms = self._resolved[0]
        return norms if isinstance(norms, ProjectedNorms) else None

    @property
    def per_layer(self) -> Union[PerLayerClipping, None]:
        """The per-layer clipping settings, or ``None`` for flat clipping."""
        clipping = self._resolved[1]
        return clipping if isinstance(clipping, PerLayerClipping) else None

    @property
    def shards_per_sample_grads(self) -> bool:
        """Whether each CP rank keeps only its shard of every per-sample gradient (V2), not all of it (V1)."""
        return self.exchange != "all_reduce"

    @property
    def output_stationary(self) -> bool:
        return self.exchange == "output_stationary"

    @property
    def checkpoints_every_block(self) -> bool:
        return self.activation_checkpointing is True or (
            type(self.activation_checkpointing) is int and self.activation_checkpointing == 1)

    def replace(self, **changes: Any) -> StrategyConfig:
        """A validated copy with some choices changed."""
        return replace(self, **changes)

    def changed_arguments(self, other: StrategyConfig) -> dict[str, Any]:
        """The arguments whose values differ in ``other`` (what to change to run ``other`` instead)."""
        return {f.name: getattr(other, f.name) for f in fields(self)
                if f.init and getattr(other, f.name) != getattr(self, f.name)}

    def as_arguments(self) -> dict[str, Any]:
        """The non-default choices as keyword arguments of `LongShieldStrategy` (for messages and YAML)."""
        return StrategyConfig().changed_arguments(self)

    def as_init_args(self) -> dict[str, Any]:
        """`as_arguments` as plain data, a run file's ``trainer.strategy.init_args`` (JSON-ready; `from_arguments`
        reads it back): a typed choice as ``{class_path, init_args}`` with its non-default parameters."""
        return {name: _plain_choice(value) for name, value in self.as_arguments().items()}

    @classmethod
    def from_arguments(cls, arguments: Mapping[str, Any]) -> StrategyConfig:
        """The configuration among a strategy's keyword arguments (e.g. a YAML ``init_args``): its other parameters
        (privacy settings, Lightning plumbing) are ignored, a key that is none of `STRATEGY_PARAMETERS` is refused
        (a misspelling would otherwise be planned at its default); typed choices may be given as
        ``{class_path, init_args}``."""
        check_strategy_parameters(arguments)
        names = {f.name for f in fields(cls) if f.init}
        chosen = {name: value for name, value in arguments.items() if name in names}
        for name, kind in TYPED_CHOICES.items():
            value = chosen.get(name)
            if isinstance(value, Mapping):
                chosen[name] = _typed_choice(name, kind, value)
        return cls(**chosen)


#: Every keyword parameter of `LongShieldStrategy.__init__`, in its order (torch-free; a test keeps it in step).
STRATEGY_PARAMETERS: tuple[str, ...] = (
    "context_parallel_size", "noise_multiplier", "target_epsilon", "target_delta", "max_grad_norm",
    "micro_batch_size", "poisson_sampling", "exchange", "overlap_communication", "communication_bucket_mb",
    "activation_checkpointing", "norms", "clipping", "shard_over", "accountant", "secure_mode", "seed",
    "noise_seed", "accelerator", "parallel_devices", "cluster_environment", "checkpoint_io", "precision_plugin",
    "process_group_backend", "timeout", "start_method", "preflight", "privacy_ledger", "checkpoint_format",
    "async_checkpoints",
)


def check_strategy_parameters(arguments: Mapping[str, Any]) -> None:
    """Refuse a key that is no parameter of `LongShieldStrategy`, naming the closest one."""
    for key in arguments:
        if key not in STRATEGY_PARAMETERS:
            close = difflib.get_close_matches(str(key), STRATEGY_PARAMETERS, n=1)
            hint = f"did you mean {close[0]!r}?" if close else "see `LongShieldStrategy`'s arguments."
            raise ValueError(f"LongShieldStrategy has no parameter {key!r}; {hint}")


def describe_arguments(arguments: Mapping[str, Any]) -> str:
    """``name=value, ...`` as Python keyword arguments."""
    return ", ".join(f"{name}={value!r}" for name, value in arguments.items())


#: The planner's named methods as the strategy's arguments (``zero-dp`` is the paper's ZeRO-DP+ baseline).
METHOD_PRESETS: dict[str, dict[str, Any]] = {
    "v1": {"exchange": "all_reduce"},
    "v2": {},
    "v3": {"activation_checkpointing": True},
    "zero-dp": {"context_parallel_size": 1, "shard_over": "all", "norms": "mixed"},
}


#: The choices that take a small typed object, by argument name.
TYPED_CHOICES: dict[str, type] = {"norms": ProjectedNorms, "clipping": PerLayerClipping}
#: Where a run file finds the typed choices' classes (``class_path``).
TYPED_CHOICES_MODULE = "lightning_longshield"


def _typed_choice(name: str, kind: type, value: Mapping[str, Any]) -> Any:
    """A typed choice from its YAML form, ``{class_path, init_args}`` or its parameters; unknown ones are named."""
    init = (value.get("init_args") or {}) if "class_path" in value or "init_args" in value else value
    if not isinstance(init, Mapping):
        raise TypeError(f"{name}: the init_args of {kind.__name__} must be a mapping of its parameters, got"
                        f" {type(init).__name__}.")
    known = [f.name for f in fields(kind)]
    unknown = [str(key) for key in init if key not in known]
    if unknown:
        raise ValueError(f"{name}: {kind.__name__} has no parameter {', '.join(map(repr, unknown))}; its parameters"
                         f" are {', '.join(known)}.")
    return kind(**init)


def _plain_choice(value: object) -> object:
    """A typed choice as ``{class_path, init_args}`` (its non-default parameters); any other value as it is."""
    if type(value) not in TYPED_CHOICES.values():
        return value
    default = type(value)()
    init_args = {f.name: getattr(value, f.name) for f in fields(value)  # type: ignore[arg-type]
                 if getattr(value, f.name) != getattr(default, f.name)}
    return {"class_path": f"{TYPED_CHOICES_MODULE}.{type(value).__name__}", "init_args": init_args}


def _check_bucket_mb(size: object) -> None:
    if isinstance(size, bool) or not isinstance(size, (int, float)):
        raise TypeError(f"communication_bucket_mb must be a number of megabytes (e.g. 25; 0: one collective per"
                        f" parameter), got {size!r} ({type(size).__name__}); give it as a number.")
    if not size >= 0:
        raise ValueError(f"communication_bucket_mb must be >= 0, got {size}.")


def _check_choice(name: str, value: object, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ValueError(f"{name}={value!r}: choose one of {choices}.")


def _check_checkpoint_policy(policy: object) -> None:
    if isinstance(policy, bool) or callable(policy):
        return
    if isinstance(policy, int):
        if policy < 1:
            raise ValueError(f"activation_checkpointing={policy}: an int checkpoints every k-th block, k >= 1.")
        return
    raise TypeError(f"activation_checkpointing must be a bool, an int or a callable, got {type(policy).__name__}.")


def _resolve_norms(norms: object) -> Union[str, ProjectedNorms]:
    if isinstance(norms, ProjectedNorms) or norms in EXACT_NORMS:
        return norms  # type: ignore[return-value]
    if norms in NORM_ESTIMATORS:
        return ProjectedNorms(str(norms))
    raise ValueError(f"norms={norms!r}: choose one of {EXACT_NORMS + NORM_ESTIMATORS} or pass"
                     " ProjectedNorms(estimator, projection_dim).")


def _resolve_clipping(clipping: object) -> Union[str, PerLayerClipping]:
    if isinstance(clipping, PerLayerClipping) or clipping == "flat":
        return clipping  # type: ignore[return-value]
    if clipping == "per_layer":
        return PerLayerClipping()
    raise ValueError(f"clipping={clipping!r}: choose one of {CLIPPING_MODES} or pass PerLayerClipping(thresholds,"
                     " kernel).")
