"""Poisson logical batches: rate, independence of draws, data-parallel disjointness, empty batches."""

from __future__ import annotations

import warnings
from collections import UserDict, namedtuple

import pytest
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, default_collate

from lightning_longshield import LongShieldStrategy
from lightning_longshield.dp_dataloaders import key_poisson_sampling, poisson_dataloader
from lightning_longshield.privacy import CollateAllowingEmpty, PoissonBatchSampler
from lightning_longshield.privacy.randomness import SecretKey
from tests.support.helpers import RandomTokens, loader, make_module, make_trainer, small_config


def test_inclusion_rate_and_epoch_length():
    sampler = PoissonBatchSampler(200, 0.05, randomness=SecretKey.from_seed(0))
    assert len(sampler) == 20
    counts = torch.zeros(200)
    batches = [b for _ in range(50) for b in sampler]
    for batch in batches:
        counts[batch] += 1
    rate = counts.sum() / (200 * len(batches))
    assert abs(rate - 0.05) < 4 * (0.05 * 0.95 / (200 * len(batches))) ** 0.5
    assert len({tuple(b) for b in batches}) > 0.9 * len(batches), "draws must differ"


def test_data_parallel_groups_are_disjoint_and_cover_the_draw():
    whole = list(PoissonBatchSampler(100, 0.3, randomness=SecretKey.from_seed(7)))
    parts = [
        list(PoissonBatchSampler(100, 0.3, randomness=SecretKey.from_seed(7), data_parallel_rank=g,
                                 data_parallel_size=3))
        for g in range(3)
    ]
    for k, batch in enumerate(whole):
        shares = [set(p[k]) for p in parts]
        assert set().union(*shares) == set(batch)
        assert sum(len(s) for s in shares) == len(batch)


def test_draws_are_addressable_for_resumption():
    full = list(PoissonBatchSampler(50, 0.2, randomness=SecretKey.from_seed(3)))
    resumed = list(PoissonBatchSampler(50, 0.2, randomness=SecretKey.from_seed(3), first_draw=2))
    assert resumed[:3] == full[2:5]


def test_empty_batches_collate_to_zero_length_tensors():
    dataset = RandomTokens(size=4, seq_len=6)
    batch = CollateAllowingEmpty(dataset, default_collate)([])
    assert batch["input_ids"].shape == (0, 6) and batch["labels"].shape == (0, 6)
    assert any(len(b) == 0 for b in PoissonBatchSampler(1000, 0.0005, randomness=SecretKey.from_seed(0)))


class _Encoding(UserDict):
    """A mapping batch type, as tokenizers' collators return (`BatchEncoding`)."""


def test_an_empty_batch_keeps_the_collated_structure():
    Pair = namedtuple("Pair", "tokens mask")

    def collate(samples):
        batch = default_collate(samples)
        return _Encoding(input_ids=batch["input_ids"], extra=[Pair(batch["labels"], batch["labels"] > 0), "tag"])

    empty = CollateAllowingEmpty(RandomTokens(size=4, seq_len=6), collate)([])
    assert isinstance(empty, _Encoding) and empty["input_ids"].shape == (0, 6)
    pair, tag = empty["extra"]
    assert isinstance(pair, Pair) and pair.tokens.shape == pair.mask.shape == (0, 6) and tag == "tag"


def test_fit_through_empty_logical_batches():
    """q = 1/40: about a third of the logical batches are empty (24 secret draws all non-empty: p = 2e-5). Each still
    is one DP step (accounted, noised); with noise 0 an empty step leaves the parameters exactly as they were."""

    class RecordSteps(Callback):
        def __init__(self) -> None:
            self.sizes, self.changed = [], []

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            self.sizes.append(len(batch["input_ids"]))
            self.before = [p.detach().clone() for p in pl_module.parameters()]

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.changed.append(any(not torch.equal(p, q) for p, q in zip(pl_module.parameters(), self.before)))

    recorder = RecordSteps()
    strategy = LongShieldStrategy(noise_multiplier=0.0, max_grad_norm=1.0, micro_batch_size=2)
    trainer = make_trainer(strategy, max_steps=24, callbacks=[recorder])
    trainer.fit(make_module(small_config(n_layers=1)), loader(RandomTokens(size=40, seq_len=8), 1))
    assert trainer.global_step == 24 and strategy.accountant.steps == 24
    assert 0 in recorder.sizes and any(size > 0 for size in recorder.sizes), recorder.sizes
    assert not any(changed for size, changed in zip(recorder.sizes, recorder.changed) if size == 0), recorder.changed
    assert any(recorder.changed)


def test_per_sample_strings_follow_their_samples():
    """``default_collate`` makes a list of a per-sample string field (a document id): an empty batch has none, and
    each micro-batch gets its own samples' ids."""
    from lightning_longshield.batching import split_into_microbatches

    class Named(RandomTokens):
        def __getitem__(self, index):
            return {**super().__getitem__(index), "doc_id": f"doc-{index}"}

    dataset = Named(size=4, seq_len=6)
    collate = CollateAllowingEmpty(dataset, default_collate)
    assert collate([])["doc_id"] == []
    batch = collate([dataset[i] for i in (1, 2, 3)])
    assert [micro["doc_id"] for micro in split_into_microbatches(batch, 2)] == [["doc-1", "doc-2"], ["doc-3"]]
    assert [micro["input_ids"].shape[0] for micro in split_into_microbatches(batch, 2)] == [2, 1]


def test_per_sample_values_of_any_plain_kind_follow_their_samples():
    """A collate's per-sample weights (a list of floats) and ``default_collate``'s per-sample sequences of strings
    (a list of B-tuples, one per position) went whole into every micro-batch: a sample's loss could read another
    sampled record's values, and its clipped gradient depend on them."""
    from lightning_longshield.batching import split_into_microbatches

    samples = [{"input_ids": torch.full((3,), i), "tags": [f"x{i}", f"y{i}"]} for i in range(4)]
    batch = {**default_collate(samples), "weight": [0.1, 0.2, 0.3, 0.4], "vocab": [7, 8, 9]}
    first, second = split_into_microbatches(batch, 2)
    assert (first["weight"], second["weight"]) == ([0.1, 0.2], [0.3, 0.4])
    assert first["tags"] == [("x0", "x1"), ("y0", "y1")] and second["tags"] == [("x2", "x3"), ("y2", "y3")]
    assert first["vocab"] == second["vocab"] == [7, 8, 9]  # not one value per sample: kept whole
    # A collate's per-sample metadata dicts went whole into every micro-batch too.
    meta = {**default_collate(samples), "meta": [{"source": f"s{i}", "weight": i / 10} for i in range(4)]}
    first, second = split_into_microbatches(meta, 2)
    assert [item["source"] for item in first["meta"]] == ["s0", "s1"]
    assert [item["source"] for item in second["meta"]] == ["s2", "s3"]
    # default_collate's per-position list of dicts (of each sample's list of dicts) holds tensors: split inside.
    nested = default_collate([{"input_ids": torch.full((3,), i), "spans": [{"start": i}, {"start": 10 + i}]}
                              for i in range(2)])
    first, second = split_into_microbatches(nested, 1)
    assert [span["start"].tolist() for span in first["spans"]] == [[0], [10]]


@pytest.mark.parametrize("shape", [(-1,), (1, -1)], ids=["T", "1xT"])
def test_positions_shared_by_the_samples_follow_them(shape):
    """``position_ids`` (T,) or (1, T) from the collate_fn count as (B, T): in the empty Poisson batch, in the batch
    size, and in a padding micro-batch taken from the dataset."""
    from lightning_longshield.batching import batch_size_of, samples_of
    from lightning_longshield.padding import ZeroWeightPadding

    def collate(samples):
        batch = default_collate(samples)
        return {**batch, "position_ids": torch.arange(batch["input_ids"].shape[1]).reshape(shape)}

    dataset = RandomTokens(size=4, seq_len=6)
    collate_or_empty = CollateAllowingEmpty(dataset, collate)
    assert collate_or_empty([])["position_ids"].shape == (0, 6)
    batch = collate_or_empty([dataset[i] for i in (0, 1, 2)])
    assert batch_size_of(batch) == 3
    padding = ZeroWeightPadding()
    padding.use_data(dataset, collate_or_empty)
    padding_batch = padding.microbatch(lambda batch: batch)
    assert batch_size_of(padding_batch) == 1 and torch.equal(padding_batch["position_ids"].reshape(1, -1),
                                                              torch.arange(6)[None])
    assert torch.equal(samples_of(batch, 1, 2)["position_ids"], torch.arange(6)[None])


def test_each_padding_micro_batch_is_a_fresh_copy():
    """A ``training_step`` may pop a key or edit a tensor of its batch in place (real batches are made anew every
    step): the padding batch, kept for the fit, was handed out itself, so the next padding micro-batch on a rank
    lacked the key (KeyError on the padding ranks alone, the others waiting in a collective)."""
    from lightning_longshield.padding import ZeroWeightPadding

    dataset = RandomTokens(size=4, seq_len=6)
    padding = ZeroWeightPadding()
    padding.use_data(dataset, CollateAllowingEmpty(dataset, default_collate))
    first = padding.microbatch(lambda batch: batch)
    first.pop("labels")
    first["input_ids"].zero_()
    second = padding.microbatch(lambda batch: batch)
    assert torch.equal(second["labels"], dataset[0]["labels"][None])
    assert torch.equal(second["input_ids"], dataset[0]["input_ids"][None])


def test_padding_without_a_dataloader_is_refused_on_every_rank_as_training_starts():
    """Padding (shard_over="all" with data parallelism) takes its batch from the training DataLoader's dataset. With
    training data that is not a DataLoader, every rank refuses in ``on_train_start`` with the fix, so no rank waits in
    a collective for another that failed only when it had to pad. One process: a callback gives the padding the mesh
    that two data-parallel groups would (nothing reaches a collective before the refusal)."""
    class TwoGroupsPadding(Callback):
        def on_fit_start(self, trainer, pl_module):
            trainer.strategy._padding.mesh = object()

    data = RandomTokens(size=8, seq_len=4)
    batches = [default_collate([data[i] for i in range(j, j + 2)]) for j in (0, 2)]
    strategy = LongShieldStrategy(noise_multiplier=1.0, poisson_sampling=False, preflight=False)
    trainer = make_trainer(strategy, max_steps=1, callbacks=[TwoGroupsPadding()])
    with pytest.raises(RuntimeError, match="not a torch DataLoader.*shard_over='context_parallel'"):
        trainer.fit(make_module(small_config()), batches)
    assert trainer.global_step == 0
    padding = strategy._padding
    padding.use_data(data, default_collate)
    padding.check_source()  # a DataLoader's dataset: nothing refused


def test_a_collate_error_quotes_nothing_of_the_sampled_records():
    """torch's message names the records' lengths and their positions in the batch (its private size)."""
    class Ragged(RandomTokens):
        def __getitem__(self, index):
            item = super().__getitem__(index)
            return {key: value[: 5 + index] for key, value in item.items()}

    dataset = Ragged(size=4, seq_len=9)
    with pytest.raises(RuntimeError) as error:
        CollateAllowingEmpty(dataset, default_collate)([dataset[0], dataset[3]])
    message = str(error.value)
    assert "could not be collated" in message and "pad" in message
    assert not any(str(number) in message for number in (5, 8, "entry"))
    assert error.value.__cause__ is None and error.value.__suppress_context__


class FirstHalf(torch.utils.data.SequentialSampler):
    """A default sampler's subclass that picks records in its own ``__iter__``."""

    def __iter__(self):
        return iter(range(len(self.data_source) // 2))


@pytest.mark.parametrize("sampler", ["subset", "weighted", "batches", "subclass", "other_source"])
def test_a_sampler_that_selects_records_is_refused(sampler):
    """Poisson sampling draws from the whole dataset: a sampler that left records out would be dropped, and those
    records trained on; the error says to select them in the dataset. A subclass of a default sampler, or a default
    one over another data source, was taken for one that reads every record."""
    from torch.utils.data import DataLoader, SequentialSampler, SubsetRandomSampler, WeightedRandomSampler

    from lightning_longshield.dp_dataloaders import poisson_dataloader

    dataset = RandomTokens(size=16, seq_len=4)
    loaders = {
        "subset": lambda: DataLoader(dataset, batch_size=4, sampler=SubsetRandomSampler(range(8))),
        "weighted": lambda: DataLoader(dataset, batch_size=4, sampler=WeightedRandomSampler([1.0] * 16, 16)),
        "batches": lambda: DataLoader(dataset, batch_sampler=[[0, 1], [2, 3]]),
        "subclass": lambda: DataLoader(dataset, batch_size=4, sampler=FirstHalf(dataset)),
        "other_source": lambda: DataLoader(dataset, batch_size=4, sampler=SequentialSampler(range(8))),
    }
    with pytest.raises(ValueError, match="would be replaced by Poisson sampling over all 16 records.*Subset"):
        poisson_dataloader(loaders[sampler](), SecretKey.from_seed(0), 0, 0, 1)
    for fine in (DataLoader(dataset, batch_size=4), DataLoader(dataset, batch_size=4, shuffle=True)):
        assert len(poisson_dataloader(fine, SecretKey.from_seed(0), 0, 0, 1)) > 0


def test_the_poisson_dataloader_keeps_the_worker_settings():
    """A ``multiprocessing_context`` of "spawn" came back as the default (fork); the sampler's generator is not
    carried (it drew the sampling the Poisson sampler replaces)."""
    from lightning_longshield.dp_dataloaders import poisson_dataloader

    original = torch.utils.data.DataLoader(RandomTokens(size=8), batch_size=2, num_workers=1,
                                           multiprocessing_context="spawn", persistent_workers=True,
                                           generator=torch.Generator().manual_seed(0), in_order=False)
    rebuilt = poisson_dataloader(original, SecretKey.from_seed(0), 0, 0, 1)
    assert rebuilt.multiprocessing_context is original.multiprocessing_context
    assert (rebuilt.num_workers, rebuilt.persistent_workers, rebuilt.pin_memory_device) == (1, True, "")
    assert rebuilt.generator is None
    # Out of order, data-parallel groups would train on parts of different draws in one step.
    assert rebuilt.in_order


def test_without_poisson_sampling_no_sample_is_in_two_groups_parts_of_a_batch():
    """``DistributedSampler`` pads its last round with repeated samples: N 3 over 2 groups gave [0, 2] and [1, 0]."""
    from lightning_longshield.dp_dataloaders import data_parallel_dataloader

    loader = torch.utils.data.DataLoader(RandomTokens(size=3), batch_size=2)
    parts = [list(data_parallel_dataloader(loader, rank, 2, training=True).sampler) for rank in (0, 1)]
    assert parts == [[0], [1]]
    evaluation = [list(data_parallel_dataloader(loader, rank, 2).sampler) for rank in (0, 1)]
    assert evaluation == [[0, 2], [1, 3]]  # every sample; 3 is a repeat of 0 that counts nothing (below)


def test_context_parallel_peers_shuffle_alike_whatever_their_global_rngs():
    """A shuffled DataLoader at data-parallel size 1 and CP 2: each peer's own `RandomSampler` drew its order from its
    global RNG, which one draw on one rank set apart, so the peers sharded different records as one sample (a record
    then in two clipped slots). The order now comes from one shared seed; one group without CP keeps its loader."""
    from lightning_longshield.dp_dataloaders import data_parallel_dataloader, shared_shuffle_seed

    shuffled = torch.utils.data.DataLoader(RandomTokens(size=16), batch_size=4, shuffle=True)
    orders = []
    for peer in range(2):
        torch.manual_seed(0)
        torch.rand(peer)  # a draw on one peer only
        for training in (True, False):
            loader = data_parallel_dataloader(shuffled, 0, 1, training=training, context_parallel_size=2,
                                              shuffle_seed=7)
            orders.append((training, list(loader.sampler)))
    assert orders[:2] == orders[2:]
    assert sorted(orders[0][1]) == list(range(16)) and orders[0][1] != list(range(16))
    assert data_parallel_dataloader(shuffled, 0, 1) is shuffled
    in_order = torch.utils.data.DataLoader(RandomTokens(size=16), batch_size=4)
    assert data_parallel_dataloader(in_order, 0, 1, context_parallel_size=2) is in_order
    for sampler in (torch.utils.data.SubsetRandomSampler(range(8)),
                    torch.utils.data.WeightedRandomSampler([1.0] * 16, 16)):  # each peer would draw its own
        drawn = torch.utils.data.DataLoader(RandomTokens(size=16), batch_size=4, sampler=sampler)
        with pytest.raises(ValueError, match="draws its own order on each of the 2 context-parallel ranks"):
            data_parallel_dataloader(drawn, 0, 1, training=True, context_parallel_size=2)
    assert shared_shuffle_seed(3, broadcast=lambda value: 0) == shared_shuffle_seed(3, broadcast=lambda value: 1)
    assert shared_shuffle_seed(None, broadcast=lambda value: 5) == 5  # rank 0's draw


def test_training_loader_options_poisson_sampling_replaces_are_named():
    dataset = RandomTokens(size=6, seq_len=6)
    loader = torch.utils.data.DataLoader(dataset, batch_size=2, drop_last=True, generator=torch.Generator())
    with pytest.warns(UserWarning, match="drop_last=True and generator do not apply under Poisson sampling"):
        poisson_dataloader(loader, SecretKey.fresh(), 0, 0, 1)


def test_an_evaluation_split_keeps_every_record_with_drop_last():
    """drop_last=True dropped each group's last partial batch: 6 records in batches of 4 over 2 groups left none."""
    from lightning_longshield.dp_dataloaders import data_parallel_dataloader

    dataset = RandomTokens(size=6, seq_len=6, ignore=False)
    dropping = torch.utils.data.DataLoader(dataset, batch_size=4, drop_last=True)
    with pytest.warns(UserWarning, match="drop_last=True split over 2 data-parallel groups .* evaluates every record"):
        parts = [list(data_parallel_dataloader(dropping, rank, 2)) for rank in (0, 1)]
    assert [sum(len(batch["input_ids"]) for batch in part) for part in parts] == [3, 3]


def test_an_evaluation_split_counts_every_record_once():
    """Evaluation pads the last round so that every data-parallel group runs as many batches (their collectives and
    the epoch's metric sync pair up); the repeated records were evaluated twice (N 5 over 2 groups: record 0 in both
    groups' loss and perplexity). Their labels are now all ignored; records of another kind are warned about."""
    from lightning_longshield.dp_dataloaders import data_parallel_dataloader

    dataset = RandomTokens(size=5, seq_len=6, ignore=False)
    parts = [list(data_parallel_dataloader(torch.utils.data.DataLoader(dataset, batch_size=2), rank, 2))
             for rank in (0, 1)]
    assert [len(part) for part in parts] == [2, 2]
    labelled = [batch["input_ids"][row].tolist() for part in parts for batch in part
                for row in range(len(batch["labels"])) if (batch["labels"][row] != -100).any()]
    assert sorted(labelled) == sorted(dataset.input_ids.tolist())
    shuffled = torch.utils.data.DataLoader(dataset, batch_size=2, shuffle=True)
    indices = [list(data_parallel_dataloader(shuffled, rank, 2).sampler) for rank in (0, 1)]
    assert sorted(index for part in indices for index in part if index < 5) == list(range(5))
    from lightning_longshield.trainer_checks import warn_validation_on_training_data

    with pytest.warns(UserWarning, match="A validation DataLoader reads the training dataset itself"):
        warn_validation_on_training_data(dataset, [data_parallel_dataloader(shuffled, 0, 2)])  # split, still seen
    tensors = torch.utils.data.TensorDataset(torch.zeros(5, 3))
    with pytest.warns(UserWarning, match="1 of them are evaluated twice"):
        data_parallel_dataloader(torch.utils.data.DataLoader(tensors, batch_size=2), 0, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        data_parallel_dataloader(torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(4, 3)),
                                                             batch_size=2), 0, 2)


@pytest.mark.parametrize("selecting", ["subset", "batch_sampler", "torch_batch_sampler", "subclass"])
def test_a_split_over_data_parallel_groups_refuses_a_selecting_sampler(selecting):
    """With several data-parallel groups every loader is split over all records of its dataset: a sampler that
    selects records (validation indices of a dataset that also holds the training records) would be replaced, and
    the training records evaluated, their loss released without noise. Refused, naming the fix (before: replaced)."""
    from lightning_longshield.dp_dataloaders import data_parallel_dataloader

    dataset = RandomTokens(size=20)
    if selecting == "subset":
        loader = torch.utils.data.DataLoader(dataset, batch_size=2,
                                             sampler=torch.utils.data.SubsetRandomSampler(range(16, 20)))
    elif selecting == "batch_sampler":
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=[[16, 17], [18, 19]])
    elif selecting == "torch_batch_sampler":  # torch's BatchSampler over a selecting one; the loader's is a default
        loader = torch.utils.data.DataLoader(dataset, batch_sampler=torch.utils.data.BatchSampler(
            torch.utils.data.SubsetRandomSampler(range(16, 20)), 2, False))
    else:
        loader = torch.utils.data.DataLoader(dataset, batch_size=2, sampler=FirstHalf(dataset))
    for training in (False, True):
        with pytest.raises(ValueError, match=r"would be replaced by a split of all 20 records.*Subset\(dataset"):
            data_parallel_dataloader(loader, 0, 2, training=training)
    assert data_parallel_dataloader(loader, 0, 1) is loader  # one group: the loader as it is


class RecordBatches(Callback):
    def __init__(self) -> None:
        self.batches: list[list[tuple[int, ...]]] = []

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
        self.batches.append(sorted(tuple(sample.tolist()) for sample in batch["input_ids"]))


def reading_stepping_batches(hook: str):
    """A module whose ``hook`` reads ``trainer.estimated_stepping_batches``, which with ``max_epochs`` builds the
    training DataLoader there and then (Lightning keeps it): in ``setup``, before the strategy's own setup; in
    ``configure_optimizers`` (a scheduler's total steps), before a checkpoint is restored."""
    module = make_module(small_config(n_layers=1), optimizer="sgd", learning_rate=1e-2)
    original = getattr(module, hook)

    def reading(*args, **kwargs):
        result = original(*args, **kwargs)
        module.total_steps = module.trainer.estimated_stepping_batches
        return result

    setattr(module, hook, reading)
    return module


def test_a_loader_built_before_the_strategys_setup_samples_poisson_batches():
    """Reading estimated_stepping_batches in setup() built the training loader before the fit was keyed: it trained on
    Lightning's fixed batches (a DistributedSampler's) while the guarantee stated Poisson sampling."""
    recorder = RecordBatches()
    trainer = make_trainer(LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3), max_steps=-1, max_epochs=2,
                           callbacks=[recorder])
    trainer.fit(reading_stepping_batches("setup"), loader(RandomTokens(size=32, seq_len=8), 4))
    assert isinstance(trainer.train_dataloader.batch_sampler, PoissonBatchSampler)
    assert len({len(batch) for batch in recorder.batches}) > 1  # 16 batches of exactly 4: p = 0.22^16 under Poisson


def test_a_resume_continues_the_sampling_when_a_hook_built_the_loader_before_the_restore(tmp_path):
    """A scheduler reading estimated_stepping_batches in configure_optimizers built the loader at the accountant's
    step 0: under noise_seed the resumed run replayed the masks of the steps before its checkpoint."""
    data = RandomTokens(size=32, seq_len=8)

    def fit(recorder: RecordBatches, max_steps: int, ckpt_path=None):
        strategy = LongShieldStrategy(noise_multiplier=1.0, target_delta=1e-3, noise_seed=123)
        trainer = make_trainer(strategy, max_steps=max_steps, max_epochs=2, callbacks=[recorder])
        trainer.fit(reading_stepping_batches("configure_optimizers"), loader(data, 4), ckpt_path=ckpt_path)
        return trainer

    whole, first, resumed = RecordBatches(), RecordBatches(), RecordBatches()
    fit(whole, -1)
    fit(first, 2).save_checkpoint(tmp_path / "step2.ckpt")
    fit(resumed, -1, ckpt_path=tmp_path / "step2.ckpt")
    assert first.batches == whole.batches[:2]
    assert resumed.batches == whole.batches[2:2 + len(resumed.batches)] and len(resumed.batches) >= 6


def test_training_starts_only_from_poisson_loaders_keyed_for_the_fit():
    key, other = SecretKey.from_seed(1), SecretKey.from_seed(2)
    plain = loader(RandomTokens(size=8, seq_len=4), 2)
    with pytest.raises(RuntimeError, match="did not turn into Poisson sampling"):
        key_poisson_sampling({"text": plain}, key, 0, reproducible=False)
    key_poisson_sampling(plain, None, 0, reproducible=False)  # poisson_sampling=False: the loader's own batches
    poisson = poisson_dataloader(plain, other, 0, 0, 1)
    key_poisson_sampling([poisson], key, 5, reproducible=True)  # not drawn yet: keyed for the fit at its step
    assert (poisson.batch_sampler.randomness, poisson.batch_sampler.next_draw) == (key, 5)
    next(iter(poisson.batch_sampler))
    key_poisson_sampling([poisson], key, 5, reproducible=True)
    drawn_early = poisson_dataloader(plain, key, 0, 0, 1)
    next(iter(drawn_early.batch_sampler))  # a worker drew ahead from step 0, before a checkpoint of step 5
    key_poisson_sampling([drawn_early], key, 5, reproducible=False)  # a fresh secret key: fresh draws all the same
    with pytest.raises(RuntimeError, match="replay the sampling of steps that already ran"):
        key_poisson_sampling([drawn_early], key, 5, reproducible=True)
    # Two loaders would draw the same masks under one key, a record of both counted twice in a step.
    with pytest.raises(RuntimeError, match="returned 2 DataLoaders.*ConcatDataset"):
        key_poisson_sampling({"a": poisson, "b": poisson_dataloader(plain, key, 0, 0, 1)}, key, 5, reproducible=False)


class _Indexed(RandomTokens):
    """`RandomTokens` whose records also carry their index."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return {**super().__getitem__(index), "index": torch.tensor(index)}


def test_every_step_trains_its_own_draw_when_epochs_are_cut_short_and_the_loader_is_rebuilt():
    """A worker prefetching batches that an epoch cut short (``limit_train_batches``) never uses, and the loader
    rebuilt every 3 epochs: each pass numbers its draws from the steps done, so step ``k`` trains draw ``k``. Before,
    the sampler's own count ran ahead by the unused prefetched draws, and the rebuilt loader, started at the steps
    done, replayed draws that steps had already trained on (steps 9 and 10 took those of 7 and 8)."""
    data = _Indexed(size=40, seq_len=8)
    trained = []

    class Record(Callback):
        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
            trained.append(sorted(batch.pop("index").tolist()))

    strategy = LongShieldStrategy(noise_multiplier=1.0, accountant="rdp", target_delta=1e-3, noise_seed=3)
    trainer = make_trainer(strategy, max_steps=-1, max_epochs=4, limit_train_batches=3,
                           reload_dataloaders_every_n_epochs=3, callbacks=[Record()])
    trainer.fit(make_module(small_config(n_layers=1)), DataLoader(data, batch_size=4, num_workers=1, prefetch_factor=2))
    assert len(trained) == 12
    key = strategy.privacy.poisson_key
    drawn = [next(iter(PoissonBatchSampler(len(data), 4 / len(data), key, first_draw=step))) for step in range(12)]
    assert trained == drawn


def test_a_dataloader_subclass_is_rebuilt_with_a_warning():
    """The strategy replaces a training loader's sampling (and, with several data-parallel groups, an evaluation
    loader's) by rebuilding a torch DataLoader: a subclass's own behaviour is then lost, which it says (before:
    silently)."""
    from lightning_longshield.dp_dataloaders import data_parallel_dataloader

    class ShardingLoader(DataLoader):
        def __iter__(self):
            return iter([])

    loader = ShardingLoader(RandomTokens(size=8), batch_size=2)
    with pytest.warns(UserWarning, match="a ShardingLoader: .* what ShardingLoader adds or overrides is not used"):
        rebuilt = poisson_dataloader(loader, SecretKey.from_seed(0), 0, 0, 1)
    assert type(rebuilt) is not ShardingLoader and len(list(rebuilt)) > 0
    with pytest.warns(UserWarning, match="a ShardingLoader"):
        data_parallel_dataloader(loader, 0, 2)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        poisson_dataloader(DataLoader(RandomTokens(size=8), batch_size=2), SecretKey.from_seed(0), 0, 0, 1)
