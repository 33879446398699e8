"""Poisson-sampled logical batches, split across data-parallel groups, and a collate that accepts empty batches."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Optional, Union

from torch.utils.data import Dataset, Sampler

from lightning_longshield.batching import samples_of
from lightning_longshield.privacy.randomness import SecretKey


class PoissonBatchSampler(Sampler[list[int]]):
    """Each batch includes every dataset index independently with probability ``sample_rate``.

    Draw ``k`` (the ``k``-th DP step of the run) compares the uniforms of draw ``k`` keyed by ``randomness`` (a
    secret key shared by all processes; a SHAKE-256 stream, see `privacy.randomness`) with the rate: every process
    draws the same Bernoulli mask. ``first_draw`` is the number of DP steps done: an int, or a function returning
    it, read as each pass over the data starts, so that the pass's ``i``-th batch is draw ``steps done + i``, the
    step that trains on it, however far a DataLoader prefetched batches an epoch cut short never used (those draws
    are taken again by the steps that use them, never twice by steps, and every data-parallel rank numbers them
    alike whatever its workers prefetch). Which samples were drawn is as secret as the noise: privacy amplification by
    sampling needs it. Data-parallel group ``g`` of ``D`` keeps the selected indices at positions ``g, g + D, ...``
    of the selection, so the groups' batches are disjoint and together form one Poisson sample. Batches may be
    empty. An epoch has ``round(1 / sample_rate)`` batches, the expected number of steps to visit every sample once.
    """

    def __init__(
        self,
        num_samples: int,
        sample_rate: float,
        randomness: SecretKey,
        first_draw: Union[int, Callable[[], int]] = 0,
        data_parallel_rank: int = 0,
        data_parallel_size: int = 1,
    ) -> None:
        if num_samples <= 0:
            raise ValueError("The training dataset is empty; DP-SGD needs at least one sample.")
        if not 0 < sample_rate <= 1:
            raise ValueError(
                f"The Poisson sampling rate is {sample_rate:.4g} (expected logical batch / dataset size) but must be"
                " in (0, 1]: lower the DataLoader's batch_size or the data-parallel size, or add data."
            )
        self.num_samples = num_samples
        self.sample_rate = sample_rate
        self.randomness = randomness
        self.steps_done = first_draw if callable(first_draw) else None
        self.next_draw = first_draw() if callable(first_draw) else first_draw
        self.first_drawn: Optional[int] = None  # the first draw taken, once one is (the DataLoader may draw ahead)
        self.data_parallel_rank = data_parallel_rank
        self.data_parallel_size = data_parallel_size
        self.num_batches = max(1, round(1 / sample_rate))

    def __len__(self) -> int:
        return self.num_batches

    def __iter__(self) -> Iterator[list[int]]:
        if self.steps_done is not None:  # read when the pass's first batch is drawn
            self.next_draw = self.steps_done()
        for _ in range(self.num_batches):
            if self.first_drawn is None:
                self.first_drawn = self.next_draw
            mask = self.randomness.uniforms(self.num_samples, "poisson", self.next_draw) < self.sample_rate
            self.next_draw += 1
            selected = mask.nonzero().flatten()
            yield selected[self.data_parallel_rank :: self.data_parallel_size].tolist()


class CollateAllowingEmpty:
    """Wraps a collate function so an empty list of samples becomes a batch of zero-length tensors.

    The empty batch keeps the usual keys and trailing shapes (taken from the first sample), so a step with no
    sampled data still flows through the training loop; a class rather than a closure so DataLoader workers can
    pickle it.
    """

    def __init__(self, dataset: Dataset, collate_fn: Callable[[list[Any]], Any]) -> None:
        self.dataset = dataset
        self.collate_fn = collate_fn

    def __call__(self, samples: list[Any]) -> Any:
        if not samples:
            return samples_of(self.collate_fn([self.dataset[0]]), 0, 0)
        try:
            return self.collate_fn(samples)
        except (RuntimeError, TypeError, ValueError) as error:
            # Not chained: collate errors quote the sampled records' values (their lengths) and their positions in the
            # batch, which tell its private size.
            raise type(error)(
                f"The sampled records could not be collated into one batch ({type(error).__name__} in the collate"
                " function; its message is withheld, as it can quote values of the sampled records). Make every"
                " record the same length (pack or pad them in the dataset), or pass a collate_fn that pads them on"
                " the right, with labels -100 (the model has no attention mask: left padding would make a record's"
                " loss depend on the longest other record sampled with it)."
            ) from None


