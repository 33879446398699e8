"""A warning when the training loop logs values that may be computed from the sampled batch, which the guarantee does
not cover."""

from __future__ import annotations

import inspect
import numbers
from collections.abc import Generator, Iterable
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torchmetrics import Metric

from lightning_longshield.privacy.rank_zero import rank_zero_warn

#: What the strategy itself logs in the training loop (`PrivacyMonitor`): the privacy spent, not a value of the data.
OWN_KEYS = frozenset({"on_train_batch_end.epsilon"})


class SampledBatchMetricGuard:
    """Warns once per metric name that a value logged in the training loop (``training_step`` or any training hook:
    ``on_train_batch_end``, ``on_train_epoch_end``, ...) is outside the privacy guarantee."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, logged_keys: Iterable[str]) -> None:
        """``logged_keys``: the keys of the training loop's results (``"<hook>.<name>"``)."""
        logged = {key.split(".", 1)[1]: key.split(".", 1)[0] for key in logged_keys if key not in OWN_KEYS}
        new = sorted(set(logged) - self.warned)
        if new:
            self.warned.update(new)
            hooks = ", ".join(sorted({logged[name] for name in new}))
            rank_zero_warn(
                f"The training loop ({hooks}) logged {new}: if computed from the sampled batch (a loss, a token count,"
                " a norm) without noise, these values are NOT covered by the differential-privacy guarantee, which"
                " protects only the noisy parameters (and what is computed from them alone). Log metrics on held-out"
                " data (validation) instead, unless releasing them is acceptable."
            )


@contextmanager
def scalar_logging_only(module: nn.Module, data_parallel_groups: int = 1) -> Generator[None, None, None]:
    """Inside, ``module.log`` (and so ``log_dict``) refuses a tensor of several values before Lightning's own error,
    which would print them: in ``training_step`` they are values of the sampled records (a per-sample loss vector).

    With several ``data_parallel_groups`` it also refuses a value synced at every call (``sync_dist=True`` unless
    ``on_step=False``): each group runs ``training_step`` once per micro-batch it drew, and under Poisson sampling
    the groups draw different numbers, so the syncs of different steps would meet (the run hangs, or pairs them)."""
    saved = module.__dict__.get("log")
    original = module.log
    # Only where a sync could hang: each micro-batch's training_step enters this, so nothing more is done per call.
    signature = inspect.signature(original) if data_parallel_groups > 1 else None

    def log(name: str, value: Any, *args: Any, **kwargs: Any) -> None:
        if not _one_value(value):
            raise ValueError(
                f"self.log({name!r}, ...) in training_step got {type(value).__name__} of more than one value: log a"
                " scalar (for per-sample losses, their mean). Its values are not quoted: they are the sampled"
                " records'."
            )
        options = signature.bind_partial(name, value, *args, **kwargs).arguments if signature is not None else {}
        if options.get("sync_dist") and options.get("on_step") is not False:
            raise ValueError(
                f"self.log({name!r}, ..., sync_dist=True) in training_step syncs across processes at every call, but"
                f" each of the {data_parallel_groups} data-parallel groups calls training_step once per micro-batch"
                " of the Poisson sample it drew, and the groups draw different numbers: the syncs of different steps"
                " would meet, and the run would hang. Log without sync_dist (each process its own value), with"
                " on_step=False (one sync at the epoch's end), or sync a held-out metric in validation_step."
            )
        original(name, value, *args, **kwargs)

    module.__dict__["log"] = log
    try:
        yield
    finally:
        del module.__dict__["log"]
        if saved is not None:
            module.__dict__["log"] = saved


def _one_value(value: Any) -> bool:
    """Whether ``value`` is one number (a Python or NumPy number, a one-element tensor or array) or a torchmetrics
    `Metric` (which Lightning computes itself), not a collection that Lightning's own error would print."""
    if isinstance(value, torch.Tensor):
        return value.numel() == 1
    return isinstance(value, (numbers.Number, Metric)) or getattr(value, "size", None) == 1
