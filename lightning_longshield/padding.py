"""Zero-weight padding micro-batches: with FSDP2 over every rank, every rank runs as many micro-batches per step."""

from __future__ import annotations

from collections.abc import Callable, Generator
from contextlib import contextmanager
from typing import Any, Optional

import lightning.pytorch as pl
import torch
import torch.distributed as dist
from lightning.fabric.utilities.apply_func import apply_to_collection
from torch.distributed.device_mesh import DeviceMesh


class ZeroWeightPadding:
    """How many padding micro-batches a rank runs after its own, and the one-sample batch they run.

    With FSDP2 over every rank (``shard_over="all"`` and data parallelism; ``mesh`` is then every rank's mesh) each
    micro-batch's forward and backward all-gather and reduce-scatter over every rank, but Poisson sampling gives each
    data-parallel group its own number of samples (possibly none): every rank runs as many micro-batches as the group
    with the most (one all-reduce of a count per step). Elsewhere (``mesh`` ``None``) FSDP2 and every per-micro-batch
    collective stay within a context-parallel group, whose ranks share each batch: no padding. A padding
    micro-batch's values never reach the clipped sum: the strategy runs it at weight zero.
    """

    def __init__(self) -> None:
        self.mesh: Optional[DeviceMesh] = None
        self._source: Optional[tuple[Any, Callable[[list[Any]], Any]]] = None
        self._batch: Any = None

    def use_data(self, dataset: Any, collate: Callable[[list[Any]], Any]) -> None:
        """Take padding batches from this training data (its first sample, collated)."""
        self._source, self._batch = (dataset, collate), None

    def count(self, own: int, device: torch.device) -> int:
        """The number of padding micro-batches after this rank's ``own`` ones (a collective over ``mesh``)."""
        if self.mesh is None:
            return 0
        most = torch.tensor([own], dtype=torch.int64, device=device)
        dist.all_reduce(most, op=dist.ReduceOp.MAX, group=self.mesh.get_group())
        return int(most.item()) - own

    def check_source(self) -> None:
        """As training starts, on every rank: padding needs training data to take its batch from. Refused where the
        training data is not a `DataLoader` (then only the ranks that must pad would fail, and the others would wait
        in a collective until its timeout)."""
        if self.mesh is not None and self._source is None:
            raise RuntimeError(
                "shard_over='all' with data parallelism runs padding micro-batches (every rank runs as many"
                " micro-batches as the data-parallel group with the most samples), taken from the training data's"
                " first sample, but the training data is not a torch DataLoader over a map-style dataset. Return"
                " one from train_dataloader, or use shard_over='context_parallel'."
            )

    def microbatch(self, to_device: Callable[[Any], Any]) -> Any:
        """The training set's first sample, collated and moved to the device like any batch (kept for the fit), in
        fresh containers and tensors each time: a ``training_step`` that pops a key or edits a tensor in place (as it
        may a real batch, made anew every step) would otherwise change the later padding micro-batches."""
        if self._batch is None:
            assert self._source is not None, "check_source() runs as training starts"
            dataset, collate = self._source
            self._batch = to_device(collate([dataset[0]]))
        return apply_to_collection(self._batch, torch.Tensor, torch.Tensor.clone)


@contextmanager
def logging_discarded(module: pl.LightningModule) -> Generator[None, None, None]:
    """``module.log`` and ``module.log_dict`` do nothing inside (instance attributes shadow the methods)."""
    names = ("log", "log_dict")
    saved = {name: module.__dict__[name] for name in names if name in module.__dict__}
    for name in names:
        module.__dict__[name] = lambda *args, **kwargs: None
    try:
        yield
    finally:
        for name in names:
            del module.__dict__[name]
        module.__dict__.update(saved)
