"""`StrategyConfig`: one description of a run's layout and clipping, shared by the strategy and the planner; every
combination of its choices is valid or refused at construction with a message that names the fix (torch-free)."""

from __future__ import annotations

import itertools
import json

import pytest

from simulate.config import make_config, method_for
from simulate.strategy_config import (
    EXACT_NORMS,
    EXCHANGES,
    METHOD_PRESETS,
    NORM_ESTIMATORS,
    SHARD_OVER,
    PerLayerClipping,
    ProjectedNorms,
    StrategyConfig,
)


def test_every_combination_is_valid_or_refused_with_the_fix() -> None:
    """The full grid of the string choices: exactly the documented rules refuse, each naming the argument to change."""
    refused = 0
    for exchange, norms, clipping, shard_over in itertools.product(
        EXCHANGES, EXACT_NORMS + NORM_ESTIMATORS, ("flat", "per_layer"), SHARD_OVER
    ):
        arguments = dict(exchange=exchange, norms=norms, clipping=clipping, shard_over=shard_over)
        per_layer_without_gradients = clipping == "per_layer" and norms != "materialize"
        output_stationary_over_all = exchange == "output_stationary" and shard_over == "all"
        if not (per_layer_without_gradients or output_stationary_over_all):
            StrategyConfig(**arguments)
            continue
        refused += 1
        with pytest.raises(ValueError) as error:
            StrategyConfig(**arguments)
        fix = "exchange='reduce_scatter'" if output_stationary_over_all else "norms='materialize'"
        assert fix in str(error.value), (arguments, str(error.value))
    # per-layer with 4 other norms (3 exchanges x 2 shardings), output-stationary over all (5 norms x 2 clippings)
    assert refused == 4 * 3 * 2 + 5 * 2 - 4 * 1 * 1


@pytest.mark.parametrize("arguments, message", [
    (dict(exchange="v1"), "exchange='v1': choose one of"),
    (dict(norms="exact"), "norms='exact': choose one of"),
    (dict(clipping="layerwise"), "clipping='layerwise': choose one of"),
    (dict(shard_over="dp"), "shard_over='dp': choose one of"),
    (dict(context_parallel_size=0), "context_parallel_size must be a positive integer"),
    (dict(micro_batch_size=1.5), "micro_batch_size must be an integer >= 1"),
    (dict(communication_bucket_mb=-1.0), "communication_bucket_mb must be >= 0"),
    (dict(activation_checkpointing=0), "k >= 1"),
])
def test_bad_values_name_the_argument(arguments, message) -> None:
    with pytest.raises(ValueError, match=message):
        StrategyConfig(**arguments)


def test_typed_choices_carry_their_parameters() -> None:
    config = StrategyConfig(norms="hutchpp", clipping="flat")
    assert config.projected_norms == ProjectedNorms("hutchpp", 32) and config.per_sample == "materialize"
    assert StrategyConfig(norms=ProjectedNorms("hutchinson", 8)).projected_norms.projection_dim == 8
    assert StrategyConfig(clipping="per_layer").per_layer == PerLayerClipping("equal", "torch")
    assert StrategyConfig().per_layer is None and StrategyConfig().projected_norms is None
    with pytest.raises(ValueError, match="k >= 3"):
        ProjectedNorms("hutchpp", 2)
    with pytest.raises(ValueError, match="finite numbers > 0"):
        PerLayerClipping(thresholds={"w": float("inf")})


def test_built_from_a_yaml_init_args_mapping() -> None:
    """What `longshield-train`'s YAML holds under ``trainer.strategy.init_args``: privacy and plumbing keys are not
    layout choices; typed choices may come as ``class_path`` / ``init_args``."""
    init_args = {
        "noise_multiplier": 1.0, "micro_batch_size": 4, "activation_checkpointing": True,
        "clipping": {"class_path": "lightning_longshield.PerLayerClipping", "init_args": {"kernel": "torch"}},
    }
    config = StrategyConfig.from_arguments(init_args)
    assert config.micro_batch_size == 4 and config.checkpoints_every_block
    assert config.per_layer == PerLayerClipping(kernel="torch")
    projected = StrategyConfig.from_arguments({"norms": {"estimator": "hutchinson", "projection_dim": 16}})
    assert projected.projected_norms == ProjectedNorms("hutchinson", 16)


@pytest.mark.parametrize("method", list(METHOD_PRESETS))
def test_planner_methods_are_presets_of_the_strategy_arguments(method) -> None:
    """``--method`` names a preset of the strategy's own arguments, and the planner runs the method it names."""
    config = StrategyConfig(**METHOD_PRESETS[method])
    assert method_for(config) == (method, ())
    planned = make_config(model="tiny", gpus=4, method=method, seq_len=1024)
    assert method_for(planned.strategy.replace(context_parallel_size=config.context_parallel_size))[0] == method


def test_changed_arguments_are_what_to_paste() -> None:
    old, new = StrategyConfig(exchange="all_reduce"), StrategyConfig(activation_checkpointing=True)
    assert old.changed_arguments(new) == {"exchange": "reduce_scatter", "activation_checkpointing": True}
    assert new.as_arguments() == {"activation_checkpointing": True}


def test_a_bucket_size_must_be_a_number() -> None:
    """A quoted number from a YAML file is refused by name, by the strategy and the planner alike."""
    for size in ("25", True, None):
        with pytest.raises(TypeError, match=f"communication_bucket_mb must be a number of megabytes .*got {size!r}"):
            StrategyConfig(communication_bucket_mb=size)
    assert StrategyConfig(communication_bucket_mb=0).communication_bucket_mb == 0


def test_typed_choices_as_plain_init_args_read_back() -> None:
    """`as_init_args` writes typed choices as a run file's ``{class_path, init_args}`` (JSON-ready), which
    `from_arguments` reads back; a parameter the choice does not have is named with those it has."""
    for config in (StrategyConfig(micro_batch_size=2, clipping=PerLayerClipping("proportional", "auto")),
                   StrategyConfig(norms=ProjectedNorms("hutchinson", 8), activation_checkpointing=True)):
        init_args = config.as_init_args()
        assert json.loads(json.dumps(init_args)) == init_args
        assert StrategyConfig.from_arguments(init_args) == config
    assert StrategyConfig(clipping=PerLayerClipping(kernel="auto")).as_init_args() == {
        "clipping": {"class_path": "lightning_longshield.PerLayerClipping", "init_args": {"kernel": "auto"}}}
    with pytest.raises(ValueError, match="norms: ProjectedNorms has no parameter 'dim'; its parameters are estimator,"
                                         " projection_dim"):
        StrategyConfig.from_arguments({"norms": {"estimator": "hutchpp", "dim": 3}})
    with pytest.raises(TypeError, match="clipping: the init_args of PerLayerClipping must be a mapping"):
        StrategyConfig.from_arguments({"clipping": {"class_path": "lightning_longshield.PerLayerClipping",
                                                    "init_args": ["torch"]}})
