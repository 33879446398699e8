"""A warning when the training loop logs values that may be computed from the sampled batch, which the guarantee does
not cover."""

from __future__ import annotations

from collections.abc import Iterable

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
