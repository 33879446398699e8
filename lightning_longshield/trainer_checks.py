"""Trainer settings that would break DP-SGD's semantics, refused before training with the fix named."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Optional

import lightning.pytorch as pl
from lightning.pytorch.callbacks import (
    DeviceStatsMonitor,
    GradientAccumulationScheduler,
    LearningRateFinder,
    SpikeDetection,
    ThroughputMonitor,
)
from lightning.pytorch.plugins.precision import HalfPrecision, MixedPrecision, Precision
from lightning.pytorch.profilers import PassThroughProfiler
from torch import Tensor

from lightning_longshield.dist_compat import all_gathered
from lightning_longshield.evaluation_split import PaddingMarked
from lightning_longshield.privacy.rank_zero import rank_zero_warn


def check_trainer_for_dp_sgd(trainer: pl.Trainer, module: pl.LightningModule, precision_plugin: Precision,
                             poisson_sampling: bool = True) -> None:
    """Raise if the trainer or module would clip, accumulate or scale gradients behind the strategy's back."""
    if not module.automatic_optimization:
        raise ValueError("LongShieldStrategy owns backward and the optimizer step; set automatic_optimization=True.")
    if any(isinstance(callback, LearningRateFinder) for callback in trainer.callbacks):
        raise ValueError(
            "The learning-rate finder (Tuner.lr_find, LearningRateFinder) is not supported: it picks the rate from the"
            " un-noised training losses of its trial steps, which are DP steps over the private data and spend the"
            " privacy budget. Choose the learning rate on public data, or account for the search."
        )
    if any(isinstance(callback, SpikeDetection) for callback in trainer.callbacks):
        raise ValueError(
            "SpikeDetection is not supported: it compares every training batch's loss, computed from the sampled"
            " records without noise, with a running mean, keeps both in every checkpoint, writes the indices of"
            " batches whose loss spiked to skip_batches.json and stops the run on them: decisions and files about the"
            " private data outside the privacy guarantee. Remove the callback; watch the validation loss on public"
            " data instead."
        )
    if any(isinstance(callback, ThroughputMonitor) for callback in trainer.callbacks):
        rank_zero_warn(
            "ThroughputMonitor logs the samples of every training batch (its batch_size_fn) and their rate without"
            " noise: under Poisson sampling a batch's size is a value of the private data, so these metrics are"
            " released outside the privacy guarantee, and an empty batch stops its count with an error. Remove the"
            " callback, or keep its logs private."
        )
    if any(isinstance(callback, DeviceStatsMonitor) for callback in trainer.callbacks):
        rank_zero_warn(
            "DeviceStatsMonitor logs the device's memory statistics at every training batch (on CUDA, cumulative"
            " allocation counts), which grow with the micro-batches run: under Poisson sampling, with the batch's"
            " size, a value of the private data, released outside the privacy guarantee. Remove the callback, or"
            " keep its logs private."
        )
    if not isinstance(trainer.profiler, PassThroughProfiler):
        rank_zero_warn(
            f"The Trainer's profiler ({type(trainer.profiler).__name__}) records every training hook and op: the"
            " per-micro-batch hooks (on_before_backward, on_after_backward) run once per micro-batch, so its report"
            " counts the sampled records (at micro_batch_size=1, exactly), and a trace gives each step's batch size,"
            " values of the private data outside the privacy guarantee. Keep its output private, or profile on"
            " public data."
        )
    if trainer.gradient_clip_val is not None:
        raise ValueError(
            "gradient_clip_val is set, but DP-SGD clips each sample's gradient itself: remove gradient_clip_val"
            " from the Trainer and set LongShieldStrategy(max_grad_norm=...) instead."
        )
    if trainer.accumulate_grad_batches != 1 or any(isinstance(callback, GradientAccumulationScheduler)
                                                   for callback in trainer.callbacks):
        raise ValueError(
            "accumulate_grad_batches must be 1 (and no GradientAccumulationScheduler change it): one optimizer step"
            " is one DP step over one logical batch. Set the logical batch with the DataLoader's batch_size and the"
            " memory with micro_batch_size."
        )
    if trainer.overfit_batches and poisson_sampling:
        rank_zero_warn(
            "overfit_batches is set, but every training batch is a fresh Poisson sample of the dataset (each record"
            " drawn independently, as the guarantee assumes): the same batches are not repeated. To train on fixed"
            " batches, pass LongShieldStrategy(poisson_sampling=False) (no formal guarantee) or a small dataset."
        )
    if isinstance(precision_plugin, MixedPrecision) and precision_plugin.scaler is not None:
        raise ValueError(
            "16-bit mixed precision with a GradScaler is not supported: loss scaling would scale the per-sample"
            " gradients before clipping. Use precision='bf16-mixed' or 'bf16-true' (or 32)."
        )
    if isinstance(precision_plugin, HalfPrecision) and precision_plugin.precision == "16-true":
        raise ValueError(
            "precision='16-true' (fp16 without loss scaling) is not supported: per-sample gradients overflow fp16's"
            " range to inf, and a sample with a non-finite gradient is dropped from the update (clip factor 0), so"
            " training would silently lose samples. Use precision='bf16-true' or 'bf16-mixed' (or 32)."
        )


def check_no_stray_trainable_tensors(uncaptured: Iterable[Tensor]) -> None:
    """Refuse trainable tensors among the optimizers' that the DP engine does not capture (``uncaptured``: not
    parameters of the module's layers, such as a tensor kept as a plain attribute or a layer in a Python list):
    backward gives them their summed, unclipped gradient, and the optimizer would apply it without noise."""
    stray = [tuple(tensor.shape) for tensor in uncaptured if tensor.requires_grad]
    if stray:
        raise ValueError(
            f"The optimizer holds {len(stray)} trainable tensor(s) that are not parameters of the module (shapes"
            f" {stray[:5]}): they would be updated from their raw gradients, summed over the batch without clipping"
            " or noise. Register them in the module (nn.Parameter on a supported layer, nn.ModuleList for lists of"
            " layers), freeze them (requires_grad=False), or leave them out of the optimizer."
        )


def planned_fit_steps(trainer: pl.Trainer, calibrating: bool) -> float:
    """The steps this fit plans: ``estimated_stepping_batches`` less the steps already taken. Where ``calibrating``
    (``target_epsilon`` alone sets the noise) and neither ``max_steps`` nor ``max_epochs`` was given, Lightning plans
    1000 epochs, and the noise is calibrated to spend the budget over all of them: warned, with the fix."""
    steps = trainer.estimated_stepping_batches - trainer.global_step
    if calibrating and trainer.global_step == 0 and trainer.max_steps == -1 and trainer.max_epochs == 1000:
        rank_zero_warn(
            f"Neither max_steps nor max_epochs is set (max_epochs is 1000, Lightning's default then): the fit plans"
            f" {steps:g} steps, and target_epsilon calibrates the noise to spend its budget over all of them, far more"
            " noise per step than a shorter run needs. Set max_steps (or max_epochs) to the run you intend."
        )
    return steps


def check_minimums_within_budget(trainer: pl.Trainer, steps_left_in_budget: int) -> None:
    """Refuse ``min_steps`` / ``min_epochs`` beyond the steps the privacy budget allows: Lightning keeps training past
    the budget's stop until they are met (or ``max_steps`` is reached), and the strategy refuses every release beyond
    it (a crash mid-fit). Lightning sets ``min_epochs=1`` itself when only ``min_steps`` is given."""
    allowed = trainer.global_step + steps_left_in_budget
    ceiling = trainer.max_steps if trainer.max_steps > 0 else float("inf")  # max_steps ends a fit before the minimums
    asked = []
    if trainer.min_steps and min(trainer.min_steps, ceiling) > allowed:
        asked.append(f"min_steps={trainer.min_steps}")
    if trainer.min_epochs and min(trainer.min_epochs * trainer.num_training_batches, ceiling) > allowed:
        asked.append(f"min_epochs={trainer.min_epochs} ({trainer.num_training_batches} steps an epoch"
                     f"{'; Lightning sets it to 1 when min_steps is given' if trainer.min_steps else ''})")
    if asked:
        raise ValueError(
            f"{' and '.join(asked)} asks for more steps than the privacy budget allows ({allowed} in all): Lightning"
            " would keep training past the budget's stop, which the strategy refuses. Lower the minimum, or allow a"
            " larger budget (target_epsilon)."
        )


def warn_validation_on_training_data(training_dataset: object, validation: object) -> None:
    """Say when a validation DataLoader of this fit (``validation``: one, or a list or dict of them) reads the
    training dataset itself: its loss is released without noise, outside the guarantee."""
    loaders = list(validation.values()) if isinstance(validation, dict) else (
        list(validation) if isinstance(validation, (list, tuple)) else [validation])
    if training_dataset is not None and any(_dataset_of(loader) is training_dataset for loader in loaders):
        rank_zero_warn(
            "A validation DataLoader reads the training dataset itself: its loss on the private training records is"
            " logged without noise, outside the privacy guarantee. Validate on held-out or public data."
        )


def _dataset_of(loader: object) -> object:
    """The dataset ``loader`` reads: an evaluation split's (`PaddingMarked`) own."""
    dataset = getattr(loader, "dataset", None)
    return dataset.dataset if isinstance(dataset, PaddingMarked) else dataset


def warn_micro_batch_above_batch(micro_batch_size: int, batch_size: Optional[int]) -> None:
    """Say when ``micro_batch_size`` exceeds the DataLoader's ``batch_size`` (the expected Poisson batch of a
    data-parallel group): micro-batches are cut from the sampled batch, so the pre-flight then plans, and may refuse,
    memory for micro-batches the run will hardly ever form."""
    if batch_size is not None and micro_batch_size > batch_size:
        rank_zero_warn(
            f"micro_batch_size={micro_batch_size} is above the DataLoader's batch_size={batch_size}, the expected"
            " sampled batch of each data-parallel group: micro-batches are cut from the sampled batch, while the"
            f" pre-flight plans memory for micro-batches of {micro_batch_size}. Set micro_batch_size at or below"
            " batch_size."
        )


def check_same_training_data(dataset_size: int, batch_size: Optional[int], split_digest: Optional[str] = None) -> None:
    """Refuse a fit whose processes hold training sets of different sizes or splits (``split_digest``, where the
    dataset has one: `LocalTextDataModule`'s) or DataLoaders of different batch sizes; a collective (every rank calls
    it, and every rank raises alike).

    Every process draws the same Poisson mask over its own copy of the training set, at the rate its own DataLoader
    gives (``batch_size`` x data-parallel size / dataset size). Only if all agree are the data-parallel groups'
    batches one Poisson sample at the rate the accountant is told; context-parallel ranks would otherwise cut shards
    of different sequences.
    """
    seen = all_gathered((dataset_size, batch_size, split_digest))
    if len(set(seen)) == 1:
        return
    ranks: dict[tuple[int, Optional[int], Optional[str]], list[int]] = {}
    for rank, value in enumerate(seen):
        ranks.setdefault(value, []).append(rank)
    splits = len({digest for _, _, digest in seen}) > 1
    held = "; ".join(f"{_rank_list(holders)}: {size} samples, batch_size={batch}"
                     + (f", split {digest[:12] if digest else None}" if splits else "")
                     for (size, batch, digest), holders in list(ranks.items())[:4])
    if len(ranks) > 4:
        held += f"; {len(ranks) - 4} other combinations"
    raise ValueError(
        f"The processes hold different training data ({held}). Every process must load the same training set (the"
        " same files, seed and val_fraction) with the same DataLoader batch_size: each draws the Poisson sample over"
        " its own copy, and the sampling rate the accountant uses is batch_size x data-parallel size / dataset size."
        " Build the dataset identically on every rank (the strategy splits the sampled batch across data-parallel"
        " groups itself)."
    )


def _rank_list(ranks: list[int]) -> str:
    shown = ", ".join(map(str, ranks[:8]))
    return f"rank{'s' if len(ranks) > 1 else ''} {shown}{', ...' if len(ranks) > 8 else ''}"
