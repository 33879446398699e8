"""Byte tokenizer, packed windows, the standard-library corpus and its train/validation split."""

from __future__ import annotations

import pytest
import torch

from lightning_longshield.text_data import (
    ByteTokenizer,
    PackedTokenDataset,
    StdlibTextDataModule,
    python_stdlib_corpus,
    python_stdlib_sources,
)


@pytest.mark.parametrize("text", ["", "def f(x):\n    return x + 1\n", "naïve café — λ 🐍"])
def test_tokenizer_round_trip(text):
    tokenizer = ByteTokenizer()
    tokens = tokenizer.encode(text)
    assert all(0 <= t < tokenizer.vocab_size for t in tokens)
    assert len(tokens) == len(text.encode("utf-8"))
    assert tokenizer.decode(tokens) == text


def test_windows_are_shifted_and_disjoint():
    tokens = torch.arange(23)
    dataset = PackedTokenDataset(tokens, seq_len=4)
    assert len(dataset) == 4  # 23 tokens hold four windows of 5; the remainder is dropped
    for i in range(len(dataset)):
        sample = dataset[i]
        assert sample["input_ids"].shape == sample["labels"].shape == (4,)
        assert sample["input_ids"].dtype == sample["labels"].dtype == torch.long
        assert torch.equal(sample["labels"][:-1], sample["input_ids"][1:])
        assert torch.equal(sample["input_ids"], torch.arange(5 * i, 5 * i + 4))
        assert sample["labels"][-1] == 5 * i + 4


@pytest.mark.parametrize(
    "tokens, seq_len, match",
    [
        (torch.arange(10), 1, "seq_len must be >= 2"),
        (torch.arange(4), 4, "fewer than one window"),
        (torch.zeros(2, 8, dtype=torch.long), 2, "1-D integer tensor"),
        (torch.zeros(8), 2, "1-D integer tensor"),
    ],
)
def test_packed_dataset_errors(tokens, seq_len, match):
    with pytest.raises(ValueError, match=match):
        PackedTokenDataset(tokens, seq_len)


def test_stdlib_sources_skip_tests_and_installed_packages():
    sources = python_stdlib_sources()
    assert sources == sorted(sources) and len(sources) > 100
    assert any(path.parent.name == "json" for path in sources)
    for path in sources:
        assert path.suffix == ".py"
        assert not {"site-packages", "test", "tests", "idle_test"} & set(path.parts)


def test_corpus_respects_limits():
    text = python_stdlib_corpus(max_bytes=5000)
    assert len(text.encode("utf-8")) <= 5000
    assert text.startswith("# file: ")
    assert python_stdlib_corpus(max_files=2).count("# file: ") == 2
    with pytest.raises(ValueError, match="max_bytes"):
        python_stdlib_corpus(max_bytes=0)


def test_train_and_validation_are_disjoint_slices_of_the_corpus():
    data = StdlibTextDataModule(seq_len=32, batch_size=4, max_bytes=20_000, val_fraction=0.1)
    data.setup()
    train, val = data.train_dataset.windows, data.val_dataset.windows
    corpus = torch.tensor(list(python_stdlib_corpus(max_bytes=20_000).encode("utf-8")))
    assert len(val) == round((len(train) + len(val)) * 0.1)
    assert torch.equal(torch.cat([train, val]).flatten(), corpus[: (len(train) + len(val)) * 33])
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape == batch["labels"].shape == (4, 32)


def test_datamodule_errors():
    with pytest.raises(ValueError, match="seq_len"):
        StdlibTextDataModule(seq_len=1)
    with pytest.raises(ValueError, match="val_fraction"):
        StdlibTextDataModule(val_fraction=1.0)
    too_small = StdlibTextDataModule(seq_len=1024, max_bytes=1500)
    with pytest.raises(ValueError, match="Raise max_bytes"):
        too_small.setup()
    with pytest.raises(RuntimeError, match="setup"):
        StdlibTextDataModule().train_dataloader()
    all_validation = StdlibTextDataModule(seq_len=99, max_bytes=300, val_fraction=0.9)
    with pytest.raises(ValueError, match="val_fraction=0.9 gives all 3 windows .* to validation.* lower val_fraction"):
        all_validation.setup()
