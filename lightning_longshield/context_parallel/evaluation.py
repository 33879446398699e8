"""Which evaluations a context-parallel layout can run: a model that `fit` laid out, and no prediction."""

from __future__ import annotations

import lightning.pytorch as pl
from lightning.pytorch.trainer.states import TrainerFn

from lightning_longshield.context_parallel.attention import ContextParallelAttention

_ONE_PROCESS = "(LongShieldStrategy(context_parallel_size=1) on devices=1, or Lightning's default strategy)"


def check_evaluation_layout(module: pl.LightningModule, stage: TrainerFn, context_parallel_size: int,
                            shard_over: str, processes: int = 1) -> None:
    """Refuse to evaluate a model that `fit` has not laid out for the strategy (each rank would attend only within its
    own shard of every sequence, a wrong loss, silently, or hold the meta-device model unmaterialised), and refuse
    prediction on several ``processes``: under context parallelism each rank would return its shard of every
    sequence's outputs, and over data-parallel groups each its part of the records (padded with repeats), ungathered.
    """
    if stage == TrainerFn.PREDICTING and context_parallel_size > 1:
        raise RuntimeError(
            f"Trainer.predict with LongShieldStrategy(context_parallel_size={context_parallel_size}) would return each"
            f" process's shard of every sequence's outputs. Predict on one process {_ONE_PROCESS}."
        )
    if stage == TrainerFn.PREDICTING and processes > 1:
        raise RuntimeError(
            f"Trainer.predict with LongShieldStrategy on {processes} processes would return each data-parallel"
            f" group's part of the records (its last round padded with repeats), never gathered. Predict on one"
            f" process {_ONE_PROCESS}."
        )
    attentions = (getattr(m, "attention_fn", None) for m in module.modules())
    unlaid = any(p.is_meta for p in module.parameters()) or (
        context_parallel_size > 1 and not any(isinstance(a, ContextParallelAttention) for a in attentions)
    )
    if unlaid:
        raise RuntimeError(
            f"Trainer.{stage.value} with LongShieldStrategy(context_parallel_size={context_parallel_size},"
            f" shard_over={shard_over!r}) needs the model laid out across the processes, which fit does: evaluate"
            f" within fit (validation runs there), with the Trainer after its fit, or on one process {_ONE_PROCESS}."
        )
