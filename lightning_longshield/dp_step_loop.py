"""`DPStepLoop`: the strategy's DP step in Lightning's loop: every micro-batch's forward and backward inside
`training_step`, the noisy release inside the optimizer step's closure."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Optional, Union

import lightning.pytorch as pl
import torch
from torch import Tensor
from torch.optim import Optimizer

from lightning_longshield.batching import batch_size_of, declare_logged_batch_size, split_into_microbatches
from lightning_longshield.padding import logging_discarded
from lightning_longshield.privacy.metric_guard import guard_logging, unguard_logging
from lightning_longshield.privacy.rank_zero import rank_zero_warn


class DPStepLoop:
    """Strategy mix-in (before Lightning's strategy in the bases): one optimizer step is one DP step over one logical
    batch. Uses the strategy's ``dp_engine``, ``privacy`` (`PrivacySession`), ``config``, ``data_parallel_size``,
    ``_padding`` (`ZeroWeightPadding`), ``_metric_guard`` (`SampledBatchMetricGuard`) and ``_shard_sequence``."""

    _scalar_loss_settled = False  # whether a scalar loss of several samples was checked (and warned about) yet
    _release_pending = False  # a logical batch ran through training_step and was not released yet
    _released_batch: Optional[int] = None  # the fit loop's count of fetched batches at the last release

    def connect(self, model: pl.LightningModule) -> None:
        """Attach ``model``, its ``self.log`` guarded until `teardown` (`GuardedLog`): in every training hook it
        refuses what would quote sampled values, and in the hooks run per micro-batch a per-call sync."""
        super().connect(model)
        guard_logging(model, lambda: self.data_parallel_size, self._metric_guard)

    def teardown(self) -> None:
        """Give the module its own ``self.log`` back (also after an error: Lightning tears down then too)."""
        if self.lightning_module is not None:
            unguard_logging(self.lightning_module)
        super().teardown()

    def training_step(self, *args: Any, **kwargs: Any) -> Any:
        """One DP step's forward and backward: every micro-batch of the logical batch is run and back-propagated here
        (the one path into backward), its clipped per-sample gradients folded into the clipped sum. Returns the last
        micro-batch's output with its loss detached: Lightning's closure finds nothing left to back-propagate. With
        FSDP2 over every rank, padding micro-batches follow (`ZeroWeightPadding`)."""
        batch, rest = args[0], args[1:]
        self._check_previous_batch_released()
        self._check_batch_not_released()
        self._release_pending = True
        self.dp_engine.begin_logical_batch()
        microbatches = split_into_microbatches(batch, self.config.micro_batch_size)
        padding = self._padding.count(len(microbatches), self.root_device)
        assert self.privacy.step_randomness is not None
        # Dropout draws as many masks as the Poisson batch has samples: keyed per step, out of the public seed's stream.
        with self.privacy.step_randomness.step(self.dp_engine.accountant.steps):
            for microbatch in microbatches:
                output = self._microbatch_step(microbatch, rest, kwargs)
            declare_logged_batch_size(self.lightning_module.trainer, batch_size_of(batch))  # for the hooks after it
            for _ in range(padding):
                self._padding_step(self._padding.microbatch(self.batch_to_device), rest, kwargs)
        if not microbatches:
            return torch.zeros((), device=self.root_device)
        return output

    def _check_previous_batch_released(self) -> None:
        """Refuse a logical batch while the previous one's clipped sum is unreleased: it would be added to this one's
        and released once, two Poisson batches as one DP step (a sample drawn in both adding up to 2 C)."""
        accumulating = self.lightning_module.trainer.accumulate_grad_batches != 1
        if not (self._release_pending or accumulating):
            return
        if accumulating:
            why = ("accumulate_grad_batches was changed during fit (e.g. by GradientAccumulationScheduler): Lightning"
                   " would run several logical batches before one optimizer step, and their clipped gradients would be"
                   " released as one DP step. It must stay 1.")
        else:
            why = ("The previous logical batch ran through training_step without an optimizer step, so its clipped"
                   " gradients were never released: they would be added to this batch's and released as one DP step."
                   " An optimizer_step override must call optimizer.step(closure=...) on every batch, not"
                   " optimizer_closure() alone.")
        raise RuntimeError(why + " One optimizer step is one DP step over one logical batch: set the logical batch with"
                           " the DataLoader's batch_size and the memory with micro_batch_size.")

    def _check_batch_not_released(self) -> None:
        """Refuse to run a logical batch that was already released: an ``optimizer_step`` override calling
        ``optimizer.step`` twice on one batch would release it twice with fresh noise (the same Poisson batch at noise
        sigma / sqrt(2)), which the accountant would count as two independent batches."""
        if self._released_batch is not None and self._released_batch == self._fetched_batches():
            raise RuntimeError(
                "This logical batch was already released by an optimizer step: a second optimizer.step(closure=...) on"
                " the same batch (an optimizer_step override stepping twice) would release it again with fresh noise,"
                " which the accountant would count as a new Poisson batch and the guarantee does not cover. Call"
                " optimizer.step once per batch."
            )

    def _fetched_batches(self) -> int:
        """How many training batches the fit loop has fetched (Lightning's progress counter, restored on resume)."""
        return self.lightning_module.trainer.fit_loop.epoch_loop.batch_progress.total.ready

    def _microbatch_step(self, microbatch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        size = batch_size_of(microbatch)
        self.dp_engine.prepare_microbatch(size)
        # What training_step logs without batch_size counts as this micro-batch's samples in an epoch's mean.
        declare_logged_batch_size(self.lightning_module.trainer, size)
        output = super().training_step(self._shard_sequence(microbatch), *rest, **kwargs)
        loss = _loss_of(output)
        if not isinstance(loss, Tensor):
            # Skipping a sampled micro-batch would be a decision on private data that the accounting does not see.
            raise TypeError(
                f"training_step returned {type(loss).__name__}, not a loss tensor: under DP every sampled micro-batch"
                " contributes its clipped gradient, and none is skipped. To leave samples out, weight their tokens'"
                " loss by 0 (labels -100) and return the loss."
            )
        total, mean = self._summed_loss(loss, size)
        self._backward_microbatch(total, mean, size)
        return {**output, "loss": mean.detach()} if isinstance(output, Mapping) else mean.detach()

    def _summed_loss(self, loss: Tensor, size: int) -> tuple[Tensor, Tensor]:
        """The sum over the micro-batch's samples of each sample's loss (whose gradient gives each sample its own
        gradient) and their mean (what hooks see), from ``training_step``'s loss: a vector of per-sample losses, or
        their mean."""
        loss = checked_loss_shape(loss, size)
        if loss.dim() == 1:
            return loss.sum(), loss.mean()
        if size > 1 and not self._scalar_loss_settled:  # decided once: the module's statement does not change
            self._scalar_loss_settled = True
            if declares_per_sample_mean_loss(self.lightning_module):
                return loss * size, loss
            rank_zero_warn(
                "training_step returned a scalar loss for a micro-batch of several samples: LongShieldStrategy takes"
                " it as the MEAN over the samples of each sample's own loss, which the clipping bound relies on. A"
                " loss averaged over all tokens of the micro-batch (F.cross_entropy over flattened logits) is not:"
                " each sample's gradient then depends on the other samples, and the guarantee does not hold. Return"
                " each sample's loss (a vector), or set per_sample_mean_loss = True on the LightningModule to state"
                " that the scalar is that mean."
            )
        return loss * size, loss

    def _padding_step(self, microbatch: Any, rest: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        """One zero-weight micro-batch (`ZeroWeightPadding`): the collectives of a real one, a contribution of exactly
        zero (the engine's ``padding`` and a loss weighted by 0), nothing logged, no backward hook."""
        self.dp_engine.prepare_microbatch(1, padding=True)
        with logging_discarded(self.lightning_module):
            output = super().training_step(self._shard_sequence(microbatch), *rest, **kwargs)
        loss = _loss_of(output)
        # Checked as a real micro-batch's is, so that a malformed loss fails on every rank, not only those with data.
        self.precision_plugin.backward(checked_loss_shape(loss, 1).sum() * 0.0, self.lightning_module, None)
        self.dp_engine.accumulate_microbatch(1)

    def _backward_microbatch(self, total: Tensor, mean: Tensor, size: int) -> None:
        """Back-propagate one micro-batch's ``total`` (the sum of its samples' losses, so that each sample's gradient
        is its own loss's) and fold its clipped per-sample gradients into the logical batch; hooks see the ``mean``.

        The gradients are folded (and ``.grad`` cleared) before ``on_after_backward`` runs, so no hook ever sees a
        sample's unclipped gradient; ``on_before_optimizer_step`` sees the private one.
        """
        module = self.lightning_module
        self.pre_backward(mean)
        self.precision_plugin.pre_backward(mean, module)  # `on_before_backward`; no loss scaling (fp16 is refused)
        self.precision_plugin.backward(total, module, None)
        self.dp_engine.accumulate_microbatch(size)
        mean = self.precision_plugin.post_backward(mean, module)
        self.post_backward(mean)

    def backward(self, closure_loss: Tensor, optimizer: Optional[Optimizer], *args: Any, **kwargs: Any) -> Tensor:
        """Lightning's closure calls this after `training_step`, which has already back-propagated every micro-batch
        of the logical batch: nothing is left to do."""
        return closure_loss

    def optimizer_step(
        self,
        optimizer: Optimizer,
        closure: Callable[[], Any],
        model: Optional[Union[pl.LightningModule, torch.nn.Module]] = None,
        **kwargs: Any,
    ) -> Any:
        self.privacy.check_release_allowed()
        evaluated = False

        def closure_then_release() -> Any:
            nonlocal evaluated
            if evaluated:
                # Before training_step runs again: nothing of this step is released twice.
                raise RuntimeError(
                    f"{type(optimizer).__name__} evaluated its closure more than once in one step (as LBFGS or"
                    " sharpness-aware optimizers do). Each evaluation would release the same private batch again, with"
                    " fresh noise, which the accountant would count as new batches and the guarantee does not cover."
                    " Use an optimizer that evaluates the closure once per step (SGD, Adam, AdamW, ...)."
                )
            evaluated = True
            result = closure()
            for tensor in self.dp_engine.uncaptured(optimizer):  # a parameter unfrozen during the step: no raw update
                tensor.grad = None
            plan = self.privacy.plan
            assert plan is not None
            self.privacy.record_release()
            self.dp_engine.release(plan.noise_multiplier, plan.sample_rate, plan.expected_batch_size)
            self._release_pending = False
            self._released_batch = self._fetched_batches()
            trainer = self.lightning_module.trainer
            if self.privacy.released(trainer.global_step):
                trainer.should_stop = True
            return result

        return super().optimizer_step(optimizer, closure_then_release, model, **kwargs)


def checked_loss_shape(loss: Tensor, size: int) -> Tensor:
    """``training_step``'s loss for a micro-batch of ``size`` samples as a scalar (their mean; any one-element loss)
    or a vector with one loss per sample; anything else is refused."""
    if loss.numel() == 1:
        return loss.reshape(())
    if loss.dim() == 1 and loss.numel() == size:
        return loss
    # Its shape not quoted: under Poisson sampling a micro-batch's size is a value of the private data.
    raise ValueError(f"training_step returned a {loss.dim()}-D loss: return each sample's loss (a vector over the"
                     " micro-batch's samples) or their mean (a scalar).")


def declares_per_sample_mean_loss(module: Any) -> bool:
    """Whether ``module`` states (``per_sample_mean_loss = True``) that its scalar ``training_step`` loss is the mean
    over samples of each sample's loss. The statement counts only where made by the class whose ``training_step``
    runs, or a subclass of it: a subclass that overrides ``training_step`` must state it anew."""
    classes = type(module).__mro__
    defining = next((c for c in classes if "training_step" in c.__dict__), None)
    declaring = next((c for c in classes if "per_sample_mean_loss" in c.__dict__), None)
    if defining is None or declaring is None or not issubclass(declaring, defining):
        return bool(module.__dict__.get("per_sample_mean_loss", False))  # stated on the instance itself
    return bool(module.per_sample_mean_loss)


def _loss_of(output: Any) -> Any:
    """The loss ``training_step`` returned: the output itself, or a dict's ``"loss"`` (a dict without one is refused,
    by its keys)."""
    if not isinstance(output, Mapping):
        return output
    if "loss" not in output:
        raise TypeError(f"training_step returned a dict without 'loss' (keys {sorted(map(str, output))}): return the"
                        " loss tensor, or a dict with it under 'loss'.")
    return output["loss"]
