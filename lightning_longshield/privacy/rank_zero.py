"""Messages from the first process only: plain log lines for information, warnings for what the user should change.

The privacy package imports nothing of Lightning; it finds its rank from ``torch.distributed`` (or, before the
process group exists, from the launcher's environment, as Lightning does) and logs through the
``lightning_longshield`` logger, set up here like Lightning's own (INFO lines shown).
"""

from __future__ import annotations

import logging
import os
import warnings

import torch.distributed as dist

LOGGER_NAME = "lightning_longshield"
log = logging.getLogger(LOGGER_NAME)
# Shown like Lightning's own INFO lines: through the root logger's handlers if it has any, else on stderr.
log.setLevel(logging.INFO)
if not logging.getLogger().hasHandlers() and not log.handlers:
    log.addHandler(logging.StreamHandler())
    log.propagate = False

#: Launchers' rank variables, in Lightning's order (`lightning_utilities.core.rank_zero._get_rank`).
_RANK_VARIABLES = ("RANK", "LOCAL_RANK", "SLURM_PROCID", "JSM_NAMESPACE_RANK")


def global_rank() -> int:
    """This process's global rank: the process group's, else the launcher's environment, else 0."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    for name in _RANK_VARIABLES:
        value = os.environ.get(name)
        if value is not None and value.strip().isdigit():
            return int(value)
    return 0


def rank_zero_info(message: str) -> None:
    """One plain log line (level INFO) from rank 0: something the user may want to know, nothing to change."""
    if global_rank() == 0:
        log.info(message)


def rank_zero_warn(message: str, stacklevel: int = 3) -> None:
    """A `UserWarning` from rank 0: something the user should change, or a guarantee that does not hold."""
    if global_rank() == 0:
        warnings.warn(message, UserWarning, stacklevel=stacklevel)
