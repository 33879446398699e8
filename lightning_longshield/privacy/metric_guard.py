"""A warning when ``training_step`` logs values computed from the sampled batch, which the guarantee does not cover."""

from __future__ import annotations

from collections.abc import Iterable

from lightning_longshield.privacy.rank_zero import rank_zero_warn


class SampledBatchMetricGuard:
    """Warns once per metric name that a value logged in ``training_step`` is outside the privacy guarantee."""

    def __init__(self) -> None:
        self.warned: set[str] = set()

    def check(self, logged_keys: Iterable[str]) -> None:
        """``logged_keys``: the trainer's result keys (``"<hook>.<name>"``); those of ``training_step`` count."""
        names = {key.split(".", 1)[1] for key in logged_keys if key.startswith("training_step.")}
        new = sorted(names - self.warned)
        if new:
            self.warned.update(new)
            rank_zero_warn(
                f"training_step logged {new}: computed from the sampled batch without noise, these values are NOT"
                " covered by the differential-privacy guarantee, which protects only the noisy parameters. Log"
                " metrics on held-out data (validation) instead, unless releasing them is acceptable."
            )
