"""What the training loop may log: a warning for values that may be computed from the sampled batch, which the
guarantee does not cover, and refusals (that quote no value) for what would print them, hang the run, or take the
library's own key."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Callable
from typing import Any, Optional

import torch
from torch import nn
from torchmetrics import Metric

from lightning_longshield.privacy.rank_zero import rank_zero_warn

#: The key under which the strategy logs the privacy spent (`PrivacyMonitor`, past the guard: `log_own`), reserved:
#: a user's is refused.
EPSILON_KEY = "epsilon"
#: The hooks that run once per micro-batch (`DPStepLoop`): each data-parallel group runs them as often as its Poisson
#: sample has micro-batches, so a collective in them meets a different collective on another group.
PER_MICROBATCH_HOOKS = frozenset({"training_step", "on_before_backward", "on_after_backward"})


class SampledBatchMetricGuard:
    """Warns once per metric name that a value logged in the training loop (``training_step`` or any training hook:
    ``on_train_batch_end``, ``on_train_epoch_end``, ...) is outside the privacy guarantee: at the ``self.log`` call
    (`GuardedLog`), before Lightning hands the value to a logger."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, hook: str, name: str) -> None:
        """``name`` is being logged in the training hook ``hook``: warn, the first time for that name."""
        if name in self.warned:
            return
        self.warned.add(name)
        rank_zero_warn(
            f"The training loop ({hook}) logged {[name]}: if computed from the sampled batch (a loss, a token count,"
            " a norm) without noise, these values are NOT covered by the differential-privacy guarantee, which"
            " protects only the noisy parameters (and what is computed from them alone). Log metrics on held-out"
            " data (validation) instead, unless releasing them is acceptable."
        )


class GuardedLog:
    """``module.log`` (and so ``log_dict``) while the strategy runs (`guard_logging`), refusing, before Lightning's own
    handling, what would quote sampled values, hang the run, or take the reserved key:

    - a value of several elements in any training hook (Lightning's own error would print them: a per-sample loss
      vector, a batch's token counts);
    - with several data-parallel groups, a value synced at every call (``sync_dist=True`` unless ``on_step=False``)
      in a hook that runs once per micro-batch (`PER_MICROBATCH_HOOKS`): under Poisson sampling the groups run
      different numbers of them, so the syncs of different steps would meet (the run hangs, or a metric is paired
      with the noisy gradient's all-reduce);
    - the key `EPSILON_KEY`, which the strategy logs itself (`log_own`);
    - in the training loop, a name that a learning-rate scheduler or a callback monitors (`_steered_by`): training
      would act on values of the sampled records that no noise covers."""

    def __init__(self, module: nn.Module, data_parallel_groups: Callable[[], int],
                 metric_guard: SampledBatchMetricGuard) -> None:
        self.module = module
        self.data_parallel_groups = data_parallel_groups  # asked only for a sync in a per-micro-batch hook
        self.metric_guard = metric_guard
        self.restores = module.__dict__.get("log")  # what `unguard_logging` puts back (an instance's own log)
        self.original = module.log
        self.signature = inspect.signature(self.original)

    def __call__(self, name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        hook = getattr(self.module, "_current_fx_name", None) or "the training loop"
        if name == EPSILON_KEY:
            raise ValueError(
                f"self.log({name!r}, ...) in {hook}: {EPSILON_KEY!r} is reserved for the privacy spent, which"
                " LongShieldStrategy logs itself. Log your metric under another name."
            )
        trainer = getattr(self.module, "_trainer", None)  # None: Lightning's log warns and logs nothing
        if trainer is not None and trainer.training and not _one_value(value):
            raise ValueError(
                f"self.log({name!r}, ...) in {hook} got {type(value).__name__} of more than one value: log a scalar"
                " (for per-sample values, their mean). Its values are not quoted: in the training loop they are the"
                " sampled records'."
            )
        if hook in PER_MICROBATCH_HOOKS and self._syncs_every_call(name, value, args, kwargs):
            groups = self.data_parallel_groups()
            if groups > 1:
                raise ValueError(
                    f"self.log({name!r}, ..., sync_dist=True) in {hook} syncs across processes at every call, but"
                    f" {hook} runs once per micro-batch, and each of the {groups} data-parallel groups runs as many"
                    " micro-batches as its Poisson sample has: the syncs of different steps would meet, and the run"
                    " would hang or add the metric to another collective. Log without sync_dist (each process its"
                    " own value), with on_step=False (one sync at the epoch's end), or sync a held-out metric in"
                    " validation_step."
                )
        if trainer is not None and trainer.training:
            consumer = _steered_by(trainer, name)
            if consumer is not None:
                raise ValueError(
                    f"self.log({name!r}, ...) in {hook} logs a value of the training loop, computed from the sampled"
                    f" batch without noise, and {consumer} monitors it: the learning rate, the stopping step or the"
                    " checkpoint kept would depend on the sampled records beyond the noisy gradient, which the"
                    " guarantee does not cover. Monitor a metric of held-out data (logged in validation_step), or"
                    f" {EPSILON_KEY!r}."
                )
            self.metric_guard.check(hook, name)
        self.original(name, value, *args, **kwargs)

    def __getstate__(self) -> dict[str, Any]:
        """A module pickled mid-run (a callback saving it whole) takes its guard along without the strategy's count
        of data-parallel groups (a closure over the strategy): the copy, outside the run, counts one."""
        return {**self.__dict__, "data_parallel_groups": _one_group}

    def _syncs_every_call(self, name: str, value: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> bool:
        """Whether this call's options (given by name or position) sync at the call: ``sync_dist`` on a step."""
        options = self.signature.bind_partial(name, value, *args, **kwargs).arguments
        return bool(options.get("sync_dist")) and options.get("on_step") is not False


def _steered_by(trainer: Any, name: str) -> Optional[str]:
    """What in ``trainer`` acts on the logged ``name`` (also as Lightning's ``name_step`` / ``name_epoch``): a
    learning-rate scheduler's ``monitor`` (ReduceLROnPlateau) or a callback's (EarlyStopping, ModelCheckpoint);
    ``None`` if nothing does."""
    keys = {name, f"{name}_step", f"{name}_epoch"}
    for config in getattr(trainer, "lr_scheduler_configs", None) or ():
        if getattr(config, "monitor", None) in keys:
            return f"the learning-rate scheduler {type(config.scheduler).__name__}"
    for callback in getattr(trainer, "callbacks", None) or ():
        if getattr(callback, "monitor", None) in keys:
            return f"the callback {type(callback).__name__}"
    return None


def _one_group() -> int:
    return 1


def guard_logging(module: nn.Module, data_parallel_groups: Callable[[], int],
                  metric_guard: SampledBatchMetricGuard) -> None:
    """Route ``module.log`` through a `GuardedLog` (an instance attribute shadowing the method) until
    `unguard_logging`. ``data_parallel_groups``: the run's number of data-parallel groups, once it is set up;
    ``metric_guard``: the run's warnings for values logged in the training loop."""
    module.__dict__["log"] = GuardedLog(module, data_parallel_groups, metric_guard)


def unguard_logging(module: nn.Module) -> None:
    """Undo `guard_logging`, if ``module.log`` is still its `GuardedLog`."""
    guarded = module.__dict__.get("log")
    if not isinstance(guarded, GuardedLog):
        return
    del module.__dict__["log"]
    if guarded.restores is not None:
        module.__dict__["log"] = guarded.restores


def log_own(module: Any, name: str, value: Any, **options: Any) -> None:
    """The strategy's own ``self.log`` (`PrivacyMonitor`'s ``epsilon``), past the `GuardedLog` that refuses the
    reserved key to users."""
    guarded = module.__dict__.get("log")
    (guarded.original if isinstance(guarded, GuardedLog) else module.log)(name, value, **options)


def _one_value(value: Any) -> bool:
    """Whether ``value`` is one number (a Python or NumPy number, a one-element tensor or array) or a torchmetrics
    `Metric` whose last call gave one (or that was only updated: Lightning computes it at the epoch's end), not a
    collection that Lightning's own error would print (a per-class accuracy's ``forward`` result, for one)."""
    if isinstance(value, Metric):
        value = value._forward_cache
        if value is None:
            return True
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, numbers.Number) or getattr(value, "size", None) == 1
