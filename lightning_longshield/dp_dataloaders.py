"""How the strategy feeds data: Poisson logical batches for training, data-parallel splits for evaluation."""

from __future__ import annotations

import secrets
from collections.abc import Callable
from typing import Any, Optional, Union

from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_longshield.evaluation_split import MarkedPaddingSampler, PaddingMarked
from lightning_longshield.privacy.poisson import CollateAllowingEmpty, PoissonBatchSampler
from lightning_longshield.privacy.randomness import SecretKey, derive_seed
from lightning_longshield.privacy.rank_zero import rank_zero_info, rank_zero_warn


class PoissonDataLoader(DataLoader):
    """The training `DataLoader` of Poisson logical batches, resumable anywhere in an epoch.

    Each batch is drawn on its own, keyed by its DP step number (`PoissonBatchSampler`), and the loader is rebuilt
    for every fit starting at the steps already taken, which the strategy's checkpoint entry (the accountant's
    history) restores. So a run resumed from a mid-epoch checkpoint continues the very sampling an uninterrupted run
    does: the same draws under ``noise_seed``, otherwise fresh secret draws, which is what the accountant assumes of
    every step (independent Poisson samples; no epoch order to lose). `state_dict` therefore holds nothing (never a
    key or which samples were drawn); having it tells Lightning that the loader is resumable.
    """

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Nothing to restore (the first draw is the number of DP steps the restored accountant has taken); says so
        in one log line."""
        sampler = self.batch_sampler
        assert isinstance(sampler, PoissonBatchSampler)
        rank_zero_info(
            f"Resuming Poisson sampling at DP step {sampler.next_draw}: every step draws its own sample, keyed by its"
            " step number, so resuming within an epoch continues exactly the sampling the accountant assumes."
        )


def rebuild_dataloader(
    dataloader: DataLoader,
    *,
    sampler: Optional[Sampler] = None,
    batch_sampler: Optional[Sampler] = None,
    collate_fn: Optional[Any] = None,
    loader_class: type[DataLoader] = DataLoader,
    dataset: Optional[Any] = None,
    drop_last: Optional[bool] = None,
) -> DataLoader:
    """A plain `DataLoader` (or ``loader_class``) over the same dataset (or ``dataset``, a view of it) and worker
    settings with a new (batch) sampler. The old loader's ``generator`` is not carried: it drew the sampling this
    replaces. Batches come in order whatever ``in_order`` said: each data-parallel group takes its part of the same
    draw at the same step, and out of order they would train on parts of different draws (a sample in two parts of
    one step). A subclass of `DataLoader` is rebuilt as ``loader_class`` too, with a warning: what it overrides would
    sample differently."""
    if type(dataloader) not in (DataLoader, PoissonDataLoader):
        name = type(dataloader).__name__
        rank_zero_warn(
            f"This DataLoader is a {name}: the strategy rebuilds it as a torch DataLoader over the same dataset,"
            f" collate_fn and worker settings, with its own sampling, so what {name} adds or overrides is not used."
            " Put that behaviour in the dataset or the collate_fn, and return a torch DataLoader.",
            stacklevel=4,
        )
    workers = dataloader.num_workers
    kwargs: dict[str, Any] = dict(
        collate_fn=collate_fn or dataloader.collate_fn,
        num_workers=workers,
        pin_memory=dataloader.pin_memory,
        timeout=dataloader.timeout,
        worker_init_fn=dataloader.worker_init_fn,
        persistent_workers=dataloader.persistent_workers if workers else False,
        pin_memory_device=dataloader.pin_memory_device,
    )
    if workers:
        kwargs["prefetch_factor"] = dataloader.prefetch_factor
        kwargs["multiprocessing_context"] = dataloader.multiprocessing_context
    dataset = dataloader.dataset if dataset is None else dataset
    if batch_sampler is not None:
        return loader_class(dataset, batch_sampler=batch_sampler, **kwargs)
    drop_last = dataloader.drop_last if drop_last is None else drop_last
    return loader_class(dataset, batch_size=dataloader.batch_size, sampler=sampler, drop_last=drop_last, **kwargs)


def poisson_dataloader(
    dataloader: DataLoader, randomness: SecretKey, first_draw: Union[int, Callable[[], int]], data_parallel_rank: int,
    data_parallel_size: int,
) -> DataLoader:
    """Replace the sampling of ``dataloader``: every batch is a Poisson sample of expected size ``batch_size``, each
    pass's first one draw ``first_draw`` (the DP steps already taken, or a function giving them as a pass starts:
    `PoissonBatchSampler`)."""
    dataset = dataloader.dataset
    size = len(dataset)  # type: ignore[arg-type]
    _refuse_a_selecting_sampler(dataloader, size)
    unused = [option for option, used in (("drop_last=True", dataloader.drop_last),
                                          ("generator", dataloader.generator is not None)) if used]
    if unused:
        rank_zero_warn(f"The training DataLoader's {' and '.join(unused)} do not apply under Poisson sampling: every"
                       " batch is a Poisson sample of expected size batch_size drawn from the run's secret key (none"
                       " is dropped, none comes from a generator of the DataLoader's).")
    sampler = PoissonBatchSampler(
        size,
        dataloader.batch_size * data_parallel_size / size,  # type: ignore[operator]
        randomness,
        first_draw=first_draw,
        data_parallel_rank=data_parallel_rank,
        data_parallel_size=data_parallel_size,
    )
    return rebuild_dataloader(
        dataloader, batch_sampler=sampler, collate_fn=CollateAllowingEmpty(dataset, dataloader.collate_fn),
        loader_class=PoissonDataLoader,
    )


def _takes_every_record(dataloader: DataLoader) -> bool:
    """Whether ``dataloader`` batches every record of its dataset once an epoch with a default sampler (sequential, or
    shuffled without replacement) and the default batch sampler: what the strategy may replace by its own split. A
    `BatchSampler` passed in (``batch_size`` None) is not: its own sampler, not the DataLoader's, picks the records,
    and a split would lose its batching."""
    if dataloader.batch_size is None:
        return False
    own = dataloader.sampler
    # The default classes themselves, over this very dataset: a subclass may pick records in its own `__iter__`, and a
    # sampler over another (smaller) data source leaves records out.
    if getattr(own, "data_source", None) is not dataloader.dataset:
        return False
    every_record = type(own) is SequentialSampler or (
        type(own) is RandomSampler and not own.replacement
        and own.num_samples == len(dataloader.dataset)  # type: ignore[arg-type]
    )
    return every_record and (dataloader.batch_sampler is None or type(dataloader.batch_sampler) is BatchSampler)


def _sampling_name(dataloader: DataLoader) -> str:
    batches = dataloader.batch_sampler
    if batches is None or (type(batches) is BatchSampler and dataloader.batch_size is not None):
        return type(dataloader.sampler).__name__
    inner = getattr(batches, "sampler", None)
    return type(batches).__name__ + (f" over a {type(inner).__name__}" if inner is not None else "")


def _refuse_a_selecting_sampler(dataloader: DataLoader, size: int) -> None:
    """Poisson sampling draws from the whole dataset: a sampler that selects or weights records would be dropped and
    the records it leaves out trained on, so only the default samplers over every record are taken."""
    if not _takes_every_record(dataloader):
        used = _sampling_name(dataloader)
        raise ValueError(
            f"The training DataLoader's {used} would be replaced by Poisson sampling over all {size} records of its"
            " dataset, so records it leaves out (or weights) would be trained on as any other. Select the records in"
            " the dataset itself (torch.utils.data.Subset(dataset, indices)) and pass batch_size with shuffle=True"
            " or the default sampler."
        )


def data_parallel_dataloader(dataloader: DataLoader, data_parallel_rank: int, data_parallel_size: int,
                             training: bool = False, context_parallel_size: int = 1,
                             shuffle_seed: int = 0) -> DataLoader:
    """Split ``dataloader`` over data-parallel groups (group ``g`` takes samples g, g+D, ...); CP peers share a split.

    The DataLoader's own shuffling is kept: a `RandomSampler` becomes a shuffling `DistributedSampler` whose order
    comes from ``shuffle_seed`` (the same on every rank) and the epoch, also in one data-parallel group of several
    context-parallel ranks. Each peer's `RandomSampler` would draw from its own global RNG, which one draw on one
    rank sets apart: the peers would then shard different records as one sample. For
    ``training`` the last ``N mod D`` samples of an epoch are left out: the sampler would otherwise pad its last round
    with repeated samples, one of them then in two groups' parts of one logical batch. Evaluation pads it with
    repeats whose labels are all ignored (`evaluation_split`), so that every record counts once. A sampler that
    selects or weights records, or a custom batch sampler, is refused (a split of every record would replace it; in
    one group of several context-parallel ranks, each would draw its own); an `IterableDataset` (evaluation) is read
    whole by every group.
    """
    if isinstance(dataloader.dataset, IterableDataset):  # a stream: each group reads it
        return dataloader
    in_order = type(dataloader.sampler) is SequentialSampler and _takes_every_record(dataloader)
    if data_parallel_size == 1 and (context_parallel_size == 1 or in_order):
        return dataloader
    if not _takes_every_record(dataloader):
        used = _sampling_name(dataloader)
        if data_parallel_size == 1:  # one group of several context-parallel ranks
            raise ValueError(
                f"This DataLoader's {used} draws its own order on each of the {context_parallel_size}"
                " context-parallel ranks, which shard one sample together: drawn apart, they would shard different"
                " records as one (a record then in two clipped slots). Select the records in the dataset itself"
                " (torch.utils.data.Subset(dataset, indices)) and pass batch_size with shuffle=True or False."
            )
        raise ValueError(
            f"This DataLoader's {used} would be replaced by a split of all {len(dataloader.dataset)} records of its"  # type: ignore[arg-type]
            f" dataset over the {data_parallel_size} data-parallel groups, so the records it leaves out would be"
            f" {'trained' if training else 'evaluated'} too (evaluated training records would release their loss"
            " without noise). Select the records in the dataset itself (torch.utils.data.Subset(dataset, indices))"
            " and pass batch_size with shuffle=True or False."
        )
    shuffle = isinstance(dataloader.sampler, RandomSampler)
    if training:
        sampler = DistributedSampler(dataloader.dataset, num_replicas=data_parallel_size, rank=data_parallel_rank,
                                     shuffle=shuffle, seed=shuffle_seed, drop_last=True)
        return rebuild_dataloader(dataloader, sampler=sampler)
    marked = PaddingMarked(dataloader.dataset)
    sampler = MarkedPaddingSampler(marked, num_replicas=data_parallel_size, rank=data_parallel_rank, shuffle=shuffle,
                                   seed=shuffle_seed)
    if dataloader.drop_last:
        rank_zero_warn(
            f"An evaluation DataLoader with drop_last=True split over {data_parallel_size} data-parallel groups would"
            " drop each group's last partial batch (up to groups x (batch_size - 1) records, possibly all): the split"
            " evaluates every record (drop_last=False)."
        )
    return rebuild_dataloader(dataloader, sampler=sampler, dataset=marked, drop_last=False)


def shared_shuffle_seed(seed: Optional[int], broadcast: Callable[[Any], Any]) -> int:
    """The seed of shuffled DataLoaders' order (without Poisson sampling, and in evaluation), the same on every rank:
    derived from the strategy's public ``seed``, else drawn by rank 0 and broadcast (``broadcast``: the strategy's).
    Never from the global RNG, whose state a draw on one rank sets apart."""
    if seed is not None:
        return derive_seed(seed, "shuffle")
    return int(broadcast(secrets.randbits(62)))


def training_dataloader(
    dataloader: DataLoader,
    sampling: Optional[SecretKey],
    steps_done: Callable[[], int],
    data_parallel_rank: int,
    data_parallel_size: int,
    context_parallel_size: int = 1,
    shuffle_seed: int = 0,
) -> DataLoader:
    """Poisson logical batches from ``sampling`` (each pass's draws numbered from ``steps_done()``, the DP steps
    taken when it starts), or, without it, the DataLoader's own batches split over data-parallel groups
    (`data_parallel_dataloader`)."""
    if sampling is None:
        return data_parallel_dataloader(dataloader, data_parallel_rank, data_parallel_size, training=True,
                                        context_parallel_size=context_parallel_size, shuffle_seed=shuffle_seed)
    return poisson_dataloader(dataloader, sampling, steps_done, data_parallel_rank, data_parallel_size)


def key_poisson_sampling(
    train_dataloader: object, sampling: Optional[SecretKey], first_draw: int, reproducible: bool
) -> None:
    """As training starts: every training loader (``trainer.train_dataloader``: one, or a list or dict of them)
    samples Poisson batches keyed by ``sampling``, the fit's key, from draw ``first_draw``, the steps the restored
    accountant has taken. Nothing to do without ``sampling`` (``poisson_sampling=False``).

    A hook that reads ``trainer.estimated_stepping_batches`` (a scheduler's total steps in ``configure_optimizers``,
    with ``max_epochs``) builds the training loader before the checkpoint is restored, so its first draw is set here.
    A loader that already drew from another first draw (its workers, started with the iterator) is refused where the
    key is reproducible (``noise_seed``): it would replay the masks of steps that ran before the checkpoint. Any other
    training loader is refused: the guarantee would state Poisson sampling that never ran, and so are several (they
    would draw the same masks, one step's batches from each, and a record in two of them would count twice).
    """
    if sampling is None:
        return
    loaders = CombinedLoader(train_dataloader).flattened
    if len(loaders) > 1:
        raise RuntimeError(
            f"train_dataloader returned {len(loaders)} DataLoaders: a DP step is one Poisson sample of one dataset,"
            " accounted at its rate. Concatenate the datasets (torch.utils.data.ConcatDataset) into one DataLoader."
        )
    for loader in loaders:
        sampler = getattr(loader, "batch_sampler", None)
        if not isinstance(loader, PoissonDataLoader) or not isinstance(sampler, PoissonBatchSampler):
            raise RuntimeError(
                f"The training DataLoader is a {type(loader).__name__} that the strategy did not turn into Poisson"
                " sampling, but the privacy guarantee assumes Poisson sampling. Return a torch DataLoader from"
                " train_dataloader and let the strategy replace its sampling (or set poisson_sampling=False, whose"
                " guarantee says it is not a formal one)."
            )
        if sampler.first_drawn is None:
            sampler.randomness, sampler.next_draw = sampling, first_draw
        elif reproducible and (sampler.randomness is not sampling or sampler.first_drawn != first_draw):
            raise RuntimeError(
                f"The training DataLoader drew Poisson batches from step {sampler.first_drawn} before the checkpoint"
                f" of step {first_draw} was restored (a hook read trainer.estimated_stepping_batches with max_epochs"
                " set, and Lightning built the loader's iterator there, whose workers draw their first batches at"
                " once): under noise_seed they would replay the sampling of steps that already ran. Set max_steps,"
                " read estimated_stepping_batches later, or use num_workers=0."
            )


def training_set_size(dataloader: DataLoader) -> int:
    """The training dataset's size, which Poisson sampling needs: an `IterableDataset` or a dataset without a length
    is refused with the fix."""
    dataset = dataloader.dataset
    if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
        raise TypeError(
            f"The training dataset ({type(dataset).__name__}) has no length: Poisson sampling draws every record"
            " independently by its index, and the sampling rate is the batch size over the dataset's size. Use a"
            " map-style dataset (with __getitem__ and __len__), not an IterableDataset."
        )
    return len(dataset)  # type: ignore[arg-type]
