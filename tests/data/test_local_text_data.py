"""LocalTextDataModule: local files -> causal-LM samples for each privacy unit, the split, the cache, the errors."""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from lightning_longshield.hf.demo import train_bpe_tokenizer
from lightning_longshield.local_text_data import BYTE_EOS, LocalTextDataModule, resolve_data_files
from lightning_longshield.loss import IGNORE_INDEX
from lightning_longshield.module import check_batch
from lightning_longshield.text_data import ByteTokenizer, python_stdlib_sources
from tests.support.helpers import write_sentencepiece_tokenizer

pytest.importorskip("datasets")
pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")
transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

SHORT = ["x = 1\n", "def f():\n    return 2\n"]  # shorter than any window below: padded in "document" samples


@pytest.fixture(scope="module")
def texts() -> list[str]:
    """Ten documents: eight small standard-library sources and two one-liners."""
    sources = [p for p in python_stdlib_sources() if 1_000 < p.stat().st_size < 6_000][:8]
    assert len(sources) == 8
    return [p.read_text(encoding="utf-8") for p in sources] + SHORT


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory, texts) -> Path:
    """A byte-level BPE tokenizer trained on the documents and saved like a Hugging Face tokenizer."""
    directory = tmp_path_factory.mktemp("tokenizer")
    train_bpe_tokenizer(texts, directory, vocab_size=400)
    return directory


def write(directory: Path, texts: list[str], kind: str, field: str = "text") -> Path:
    """``texts`` as one .txt file each, or as the lines / rows of one .jsonl / .parquet file; returns the path
    that names them all (the directory of .txt files, or the file)."""
    directory.mkdir(parents=True, exist_ok=True)
    if kind == "txt":
        for i, text in enumerate(texts):
            (directory / f"doc{i:02d}.txt").write_text(text, encoding="utf-8")
        return directory
    path = directory / f"docs.{kind}"
    if kind == "jsonl":
        path.write_text("".join(json.dumps({"id": i, field: t}) + "\n" for i, t in enumerate(texts)), encoding="utf-8")
    else:
        pq.write_table(pa.table({"id": list(range(len(texts))), field: texts}), path)
    return path


def module(data_files, tmp_path: Path, **kwargs) -> LocalTextDataModule:
    kwargs = {"seq_len": 64, "val_fraction": 0.0, "cache_dir": tmp_path / "cache", **kwargs}
    dm = LocalTextDataModule(data_files, **kwargs)
    dm.setup("fit")
    return dm


def expected_tokens(text: str, tokenizer_dir: Path | None) -> list[int]:
    """A document's tokens computed apart from the module: bytes then NUL, or the tokenizer's ids then EOS."""
    if tokenizer_dir is None:
        return ByteTokenizer().encode(text) + [BYTE_EOS]
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    return tokenizer.encode(text) + [tokenizer.eos_token_id]


def assert_document_sample(sample: dict[str, torch.Tensor], tokens: list[int], seq_len: int, pad_id: int) -> None:
    """One document -> one sample: its first seq_len + 1 tokens, input padded with pad_id, labels -100 beyond."""
    kept = tokens[: seq_len + 1]
    n = min(len(kept), seq_len)
    input_ids, labels = sample["input_ids"].tolist(), sample["labels"].tolist()
    assert len(input_ids) == len(labels) == seq_len
    assert input_ids == kept[:n] + [pad_id] * (seq_len - n)
    assert labels == kept[1:] + [IGNORE_INDEX] * (seq_len - len(kept) + 1)
    for t in range(seq_len - 1):
        if labels[t] != IGNORE_INDEX:
            assert labels[t] == input_ids[t + 1]


@pytest.mark.parametrize("kind", ["txt", "jsonl", "parquet"])
def test_each_format_gives_one_sample_per_document(kind, texts, tokenizer_dir, tmp_path):
    dm = module(write(tmp_path / "data", texts, kind), tmp_path, tokenizer=str(tokenizer_dir),
                privacy_unit="document")
    assert dm.train_documents == list(range(len(texts))) and dm.val_dataset is None
    assert len(dm.train_dataset) == len(texts)
    pad = dm.tokenizer.pad_token_id
    for i, text in enumerate(texts):
        assert_document_sample(dm.train_dataset[i], expected_tokens(text, tokenizer_dir), 64, pad)
    assert dm.vocab_size == len(dm.tokenizer)
    kind_name = {"txt": "a .txt file", "jsonl": "a .jsonl line", "parquet": "a .parquet row"}[kind]
    assert dm.describe_privacy_unit() == f"one document ({kind_name}), truncated to 65 tokens"


@pytest.mark.parametrize("use_tokenizer", [False, True], ids=["bytes", "bpe"])
def test_sequence_windows_are_disjoint_and_cover_the_training_documents(use_tokenizer, texts, tokenizer_dir,
                                                                         tmp_path):
    tokenizer = tokenizer_dir if use_tokenizer else None
    dm = module(write(tmp_path / "data", texts, "jsonl"), tmp_path, tokenizer=tokenizer, seq_len=32,
                val_fraction=0.2)
    assert len(dm.val_documents) == 2 and sorted(dm.train_documents + dm.val_documents) == list(range(len(texts)))
    for documents, dataset in ((dm.train_documents, dm.train_dataset), (dm.val_documents, dm.val_dataset)):
        stream = [token for i in documents for token in expected_tokens(texts[i], tokenizer)]
        assert len(dataset) == len(stream) // 33
        for k in range(len(dataset)):
            window = stream[k * 33 : (k + 1) * 33]
            assert dataset[k]["input_ids"].tolist() == window[:-1] and dataset[k]["labels"].tolist() == window[1:]
    check_batch(next(iter(dm.train_dataloader())), dm.vocab_size)
    assert len(next(iter(dm.train_dataloader()))["input_ids"]) == dm.batch_size == 8
    assert dm.describe_privacy_unit() == (
        "one sequence of 33 tokens of concatenated documents; a document spanning several sequences is"
        " protected only per sequence"
    )


@pytest.fixture(scope="module")
def sentencepiece_dir(tmp_path_factory, texts) -> Path:
    pytest.importorskip("sentencepiece")
    directory = tmp_path_factory.mktemp("sentencepiece")
    write_sentencepiece_tokenizer(directory, texts)
    return directory


def test_a_sentencepiece_tokenizer_under_a_home_relative_path_is_read(texts, sentencepiece_dir, tmp_path,
                                                                      monkeypatch):
    monkeypatch.setenv("HOME", str(sentencepiece_dir.parent))
    dm = module(write(tmp_path / "data", texts, "jsonl"), tmp_path, tokenizer=f"~/{sentencepiece_dir.name}",
                seq_len=32)
    tokenizer = transformers.AutoTokenizer.from_pretrained(sentencepiece_dir, local_files_only=True)
    stream = [token for i in dm.train_documents for token in tokenizer.encode(texts[i]) + [tokenizer.eos_token_id]]
    assert stream[0] == tokenizer.bos_token_id == 1 and dm.vocab_size == 200
    assert dm.train_dataset[0]["input_ids"].tolist() == stream[:32]


def test_a_tokenizer_without_its_tokenizer_config_is_warned_about(sentencepiece_dir, tmp_path):
    """transformers reads a lone ``tokenizer.model`` as a generic tokenizer that adds no BOS: the ids then differ
    from the checkpoint's training data's, silently."""
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(sentencepiece_dir, bare)
    (bare / "tokenizer_config.json").unlink()
    with pytest.warns(UserWarning, match="no tokenizer_config.json.*Copy the checkpoint's tokenizer_config.json"):
        LocalTextDataModule._load_tokenizer(bare)


def test_a_sentencepiece_tokenizer_without_its_packages_names_them(sentencepiece_dir, tmp_path, monkeypatch):
    def unreadable(*args, **kwargs):
        raise ImportError("LlamaTokenizer requires the SentencePiece library")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreadable)
    with pytest.raises(ValueError, match="pip install sentencepiece protobuf"):
        LocalTextDataModule(write(tmp_path, SHORT, "jsonl"), tokenizer=sentencepiece_dir)


@pytest.mark.parametrize("which", ["byte-level-bpe", "sentencepiece"])
def test_a_long_document_is_tokenized_only_as_far_as_its_sample_reaches(which, texts, tokenizer_dir,
                                                                       sentencepiece_dir, tmp_path, monkeypatch):
    """The document unit keeps a document's first seq_len + 1 tokens: they come from a prefix of it, equal to the
    whole text's (Llama 3- and Llama 2-style tokenizers), and the tokenizer never sees the whole 300 KB text."""
    directory = tokenizer_dir if which == "byte-level-bpe" else sentencepiece_dir
    documents = ["".join(texts[:8]) * 10, "x" * 40_000 + " " + texts[0] * 10, texts[0], "y" * 60_000]
    tokenizer = transformers.AutoTokenizer.from_pretrained(directory, local_files_only=True)
    expected = [tokenizer.encode(text) + [tokenizer.eos_token_id] for text in documents]
    call, seen = type(tokenizer).__call__, []

    def recording(self, text, *args, **kwargs):
        seen.extend(len(t) for t in ([text] if isinstance(text, str) else text))
        return call(self, text, *args, **kwargs)

    monkeypatch.setattr(type(tokenizer), "__call__", recording)
    dm = module(write(tmp_path / "data", documents, "jsonl"), tmp_path, tokenizer=str(directory),
                privacy_unit="document", seq_len=256)
    for i, tokens in enumerate(expected):
        assert_document_sample(dm.train_dataset[i], tokens, 256, dm.pad_token_id)
        assert len(dm._tokenize()[i]["input_ids"]) == min(len(tokens), 257)  # nothing past the sample is kept
    # The first and third documents by a prefix of 8 x (257 + 64) characters and the rest of a word, the second (a
    # 40,000 character word first) up to that word's end, the last (no whitespace) whole.
    *prefixes, word, whole = sorted(seen)
    assert len(prefixes) == 2 and all(8 * (257 + 64) <= length < 8 * (257 + 64) + 100 for length in prefixes)
    assert (word, whole) == (40_000, 60_000)


def test_documents_of_a_map_call_add_up_to_a_bounded_length(tmp_path):
    from lightning_longshield.local_text_data import MAP_BATCH_CHARACTERS, _map_batch_size

    books = []
    for i in range(3):
        books.append(tmp_path / f"book{i}.txt")
        books[-1].write_bytes(b"a" * (MAP_BATCH_CHARACTERS // 2))
    assert _map_batch_size([str(book) for book in books], 3) == 2  # a folder of books: two at a time
    lines = tmp_path / "lines.jsonl"
    lines.write_text('{"text": "x"}\n' * 5000)
    assert _map_batch_size([str(lines)], 5000) == 1000  # short documents: datasets' default


def test_document_split_is_seeded_disjoint_and_drops_empty_documents(texts, tmp_path):
    data = write(tmp_path / "data", texts[:4] + [""] + texts[4:], "jsonl")  # document 4 has no text
    dm = module(data, tmp_path, privacy_unit="document", val_fraction=0.3, val_batch_size=2)
    assert len(dm.val_documents) == 3 and 4 not in dm.train_documents + dm.val_documents
    assert not set(dm.train_documents) & set(dm.val_documents)
    assert len(dm.train_dataset) + len(dm.val_dataset) == len(texts)
    with_empty = texts[:4] + [""] + texts[4:]
    for documents, dataset in ((dm.train_documents, dm.train_dataset), (dm.val_documents, dm.val_dataset)):
        for k, i in enumerate(documents):
            assert_document_sample(dataset[k], expected_tokens(with_empty[i], None), 64, BYTE_EOS)
    assert len(next(iter(dm.val_dataloader()))["input_ids"]) == 2
    same = module(data, tmp_path, privacy_unit="document", val_fraction=0.3)
    other = module(data, tmp_path, privacy_unit="document", val_fraction=0.3, seed=1)
    assert same.val_documents == dm.val_documents and other.val_documents != dm.val_documents
    # what a resume compares (the privacy plan keeps it): the same split, the same digest
    assert same.train_dataset.split_digest == dm.train_dataset.split_digest != other.train_dataset.split_digest
    # Kept in checkpoints: from public settings only, so a dataset that differs in one document has the same digest
    # (it hashed the files' sizes, which told the two apart).
    neighbour = write(tmp_path / "neighbour", texts[:3] + ["a document of another length"] + [""] + texts[4:], "jsonl")
    neighbouring = module(neighbour, tmp_path, privacy_unit="document", val_fraction=0.3)
    assert neighbouring.train_dataset.split_digest == dm.train_dataset.split_digest
    assert dm.vocab_size == 256 and dm.describe_privacy_unit().startswith("one document (a .jsonl line)")


def test_validation_never_comes_from_the_private_documents_by_default(texts, tmp_path):
    """The validation loss is logged without noise: by default no validation set is carved from data_files (every
    private document is trained on), public documents come in through val_files, and val_fraction > 0 warns that
    its held-out documents are released un-noised and outside the guarantee."""
    data = write(tmp_path / "data", texts, "jsonl")
    dm = LocalTextDataModule(data, seq_len=64, privacy_unit="document", cache_dir=tmp_path / "cache")
    dm.setup("fit")
    assert dm.val_fraction == 0 and dm.val_dataset is None and dm.val_dataloader() == []
    assert dm.train_documents == list(range(len(texts))) and dm.val_documents == []

    public = write(tmp_path / "public", texts[:3] + [""], "jsonl")  # the empty document is dropped
    for unit in ("document", "sequence"):
        dm = module(data, tmp_path, privacy_unit=unit, seq_len=32, val_files=public, val_batch_size=2)
        assert dm.train_documents == list(range(len(texts))) and dm.val_documents == []
        if unit == "document":
            assert len(dm.val_dataset) == 3
            for k in range(3):
                assert_document_sample(dm.val_dataset[k], expected_tokens(texts[k], None), 32, BYTE_EOS)
        else:
            stream = [token for text in texts[:3] for token in expected_tokens(text, None)]
            assert len(dm.val_dataset) == len(stream) // 33
            assert dm.val_dataset[0]["input_ids"].tolist() == stream[:32]
        assert len(next(iter(dm.val_dataloader()))["input_ids"]) == 2

    with pytest.warns(UserWarning, match=r"(?s)val_fraction=0.2 holds out .* private documents.*logged without"
                                         r" noise.*outside the training set that the DP guarantee covers"):
        dm = module(data, tmp_path, privacy_unit="document", val_fraction=0.2)
    assert len(dm.val_documents) == 2
    with pytest.raises(ValueError, match="val_files .* or val_fraction .* not both"):
        LocalTextDataModule(data, val_files=public, val_fraction=0.1)
    with pytest.raises(FileNotFoundError, match="No .* files match"):
        LocalTextDataModule(data, val_files=tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="No text in the 1 val_files"):
        module(data, tmp_path, val_files=write(tmp_path / "blank", ["", ""], "jsonl"))


def test_files_directories_globs_and_max_documents(texts, tmp_path):
    directory = write(tmp_path / "txt", texts[:3], "txt")
    (directory / "README.md").write_text("not data")  # a directory means its supported files only
    jsonl = write(tmp_path / "jsonl", texts[3:], "jsonl")
    files = resolve_data_files([directory, str(tmp_path / "jsonl" / "*.jsonl"), directory / "doc00.txt"])
    assert [p.name for p in files] == ["doc00.txt", "doc01.txt", "doc02.txt", "docs.jsonl"]
    dm = module([directory, jsonl], tmp_path, privacy_unit="document")
    assert len(dm.train_dataset) == len(texts)
    assert dm.describe_privacy_unit().startswith("one document (a .txt file or a .jsonl line)")
    assert len(module([directory, jsonl], tmp_path, privacy_unit="document", max_documents=4).train_dataset) == 4
    os.link(directory / "doc01.txt", tmp_path / "again.txt")  # a hard link (cp -l, a snapshot) is the same file
    (tmp_path / "link.txt").symlink_to(directory / "doc02.txt")
    files = resolve_data_files([directory, tmp_path / "again.txt", tmp_path / "link.txt"])
    assert [p.name for p in files] == ["doc00.txt", "doc01.txt", "doc02.txt"]  # one sample per document, not two


def test_special_tokens_written_in_a_document_are_text(texts, tokenizer_dir, tmp_path):
    """A chat log quoting "<eos>" must not put an end of document (or turn) in the middle of its tokens."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    quoted = f"the log ends with {tokenizer.eos_token} and {tokenizer.pad_token} here"
    data = write(tmp_path / "data", [quoted, texts[0]], "jsonl")
    sample = module(data, tmp_path, tokenizer=str(tokenizer_dir), privacy_unit="document").train_dataset[0]
    length = int((sample["labels"] != IGNORE_INDEX).sum()) + 1  # the document's tokens, before the padding
    ids = sample["input_ids"][:length].tolist()
    assert ids[-1] == tokenizer.eos_token_id and tokenizer.decode(ids[:-1]) == quoted
    assert tokenizer.eos_token_id not in ids[:-1] and tokenizer.pad_token_id not in ids


class CountingTokenizer(ByteTokenizer):
    """Bytes, counting the texts encoded (in a module-level list, so the tokenizer's own state never changes)."""

    def encode(self, text: str) -> list[int]:
        ENCODED.append(text)
        return super().encode(text)


ENCODED: list[str] = []


def test_second_setup_reuses_the_cached_tokens(texts, tokenizer_dir, tmp_path):
    data = write(tmp_path / "data", texts, "jsonl")
    ENCODED.clear()
    first = module(data, tmp_path, tokenizer=CountingTokenizer())
    assert len(ENCODED) == len(texts)
    ENCODED.clear()
    second = module(data, tmp_path, tokenizer=CountingTokenizer())
    assert ENCODED == [] and torch.equal(first.train_dataset.windows, second.train_dataset.windows)

    cache = tmp_path / "cache"
    module(data, tmp_path, tokenizer=tokenizer_dir)
    files = {p: p.stat().st_mtime_ns for p in cache.rglob("cache-*.arrow")}
    module(data, tmp_path, tokenizer=tokenizer_dir)
    assert {p: p.stat().st_mtime_ns for p in cache.rglob("cache-*.arrow")} == files


TOKENIZER_MODULE = """
class ShiftTokenizer:
    vocab_size = 300

    def encode(self, text):
        return [byte + {shift} for byte in text.encode()]
"""
#: The same as a subclass of transformers' slow tokenizer (its ids are the bytes shifted, as above).
TRANSFORMERS_TOKENIZER_MODULE = """
from transformers import PreTrainedTokenizer


class ShiftTokenizer(PreTrainedTokenizer):
    def __init__(self, **kwargs):
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return 300

    def get_vocab(self):
        return {{chr(i): i for i in range(300)}}

    def _tokenize(self, text):
        return [chr(byte) for byte in text.encode()]

    def _convert_token_to_id(self, token):
        return ord(token) + {shift}

    def _convert_id_to_token(self, index):
        return chr(index)
"""


@pytest.mark.parametrize("template", [TOKENIZER_MODULE, TRANSFORMERS_TOKENIZER_MODULE], ids=["plain", "transformers"])
def test_a_custom_tokenizer_whose_code_changed_tokenizes_again(template, texts, tmp_path, monkeypatch):
    """`datasets` keys a tokenizer object by its class's name and state: the class's code must count too, or an
    edited `encode` would train on the old code's tokens. The code as loaded counts, not the file: a file edited
    but not yet reloaded still tokenizes with the old code, whose tokens must not be cached as the new code's. A
    user's subclass of a transformers tokenizer counts as its own code (its edits reused the old tokens)."""
    import importlib

    if template is TRANSFORMERS_TOKENIZER_MODULE:
        pytest.importorskip("transformers")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(sys, "dont_write_bytecode", True)  # no cached bytecode of the first version
    data = write(tmp_path / "data", texts[:2], "jsonl")
    source = tmp_path / "shift_tokenizer.py"

    def first_tokens(tokenizer) -> list[int]:  # the same cache_dir every time
        return module(data, tmp_path, tokenizer=tokenizer, privacy_unit="document").train_dataset[0]["input_ids"][:5]

    expected = {shift: [byte + shift for byte in texts[0].encode()[:5]] for shift in (1, 20)}
    try:
        source.write_text(template.format(shift=1))
        loaded = importlib.import_module("shift_tokenizer")
        assert first_tokens(loaded.ShiftTokenizer()).tolist() == expected[1]
        source.write_text(template.format(shift=20))  # edited, not reloaded: the old code runs
        assert first_tokens(loaded.ShiftTokenizer()).tolist() == expected[1]
        importlib.invalidate_caches()
        reloaded = importlib.reload(loaded)
        assert first_tokens(reloaded.ShiftTokenizer()).tolist() == expected[20]
    finally:
        sys.modules.pop("shift_tokenizer", None)


def test_a_file_rewritten_with_its_time_kept_is_read_again(texts, tmp_path):
    """``cp -p``, ``rsync -a`` or an archive keep a file's modification time, which alone keys `datasets`' cache: the
    rewritten file (a document deleted from it) must not train on its old tokens."""
    data = write(tmp_path / "data", texts[:3], "jsonl")
    assert len(module(data, tmp_path, privacy_unit="document").train_dataset) == 3
    kept = data.stat()
    data.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts[1:3]), encoding="utf-8")
    os.utime(data, ns=(kept.st_atime_ns, kept.st_mtime_ns))
    assert len(module(data, tmp_path, privacy_unit="document").train_dataset) == 2


def test_validation_files_among_the_training_files_are_refused(texts, tmp_path):
    data = write(tmp_path / "data", texts, "txt")
    linked = tmp_path / "public" / "linked.txt"  # a hard link: another name, the same training file
    linked.parent.mkdir()
    os.link(data / "doc00.txt", linked)
    for val_files in (data / "doc00.txt", data, linked):
        with pytest.raises(ValueError, match="val_files and data_files share .* trained on and their validation"):
            LocalTextDataModule(data, val_files=val_files)


def test_errors_name_the_fix(texts, tokenizer_dir, tmp_path):
    data = write(tmp_path / "data", texts, "jsonl", field="content")
    with pytest.raises(FileNotFoundError, match="No .* files match data_files entry"):
        LocalTextDataModule(tmp_path / "missing" / "*.jsonl")
    (tmp_path / "notes.csv").write_text("a,b\n")
    with pytest.raises(ValueError, match=r"Unsupported file type\(s\) \['notes.csv'\]"):
        LocalTextDataModule(tmp_path / "notes.csv")
    with pytest.raises(ValueError, match="privacy_unit must be 'sequence' or 'document', got 'user'"):
        LocalTextDataModule(data, privacy_unit="user")
    with pytest.raises(ValueError, match=r"has no field 'text'; its fields are \['id', 'content'\]: pass text_field"):
        module(data, tmp_path)
    assert len(module(data, tmp_path, text_field="content").train_dataset) > 0
    (tmp_path / "numbers.jsonl").write_text('{"text": 5}\n')
    with pytest.raises(ValueError, match="Field 'text' of .*numbers.jsonl holds Value\\('int64'\\), not text"):
        module(tmp_path / "numbers.jsonl", tmp_path)
    with pytest.raises(ValueError, match="No text in 1 file"):
        module(write(tmp_path / "empty", ["", ""], "jsonl"), tmp_path)
    with pytest.raises(ValueError, match="training documents hold fewer tokens than one window of seq_len"):
        module(write(tmp_path / "short", ["x = 1\n"], "txt"), tmp_path)
    with pytest.raises(ValueError, match="1 document.* cannot be split .* val_fraction=0"):
        module(write(tmp_path / "one", texts[:1], "txt"), tmp_path, val_fraction=0.1)
    with pytest.raises(TypeError, match="object with encode"):
        LocalTextDataModule(data, tokenizer=object())
    for missing in (tmp_path / "no-tokenizer", "no-such-org/no-such-tokenizer"):
        with pytest.raises(FileNotFoundError, match=f"No tokenizer folder at {re.escape(str(missing))} .* Pass"):
            LocalTextDataModule(data, tokenizer=missing)
    dm = LocalTextDataModule(data, tokenizer=tokenizer_dir)
    dm.check_vocab(dm.vocab_size)
    with pytest.raises(ValueError, match=f"tokenizer has {dm.vocab_size} tokens but the model's embedding has 256"):
        dm.check_vocab(256)


def test_a_byte_order_mark_is_not_text_and_records_with_other_fields_are_named(tmp_path):
    """A .txt file saved with a UTF-8 byte-order mark trained on its three bytes (.jsonl dropped it); .jsonl records
    whose fields differ between files failed with "check that each is a valid json file", hiding the cause."""
    (tmp_path / "bom").mkdir()
    (tmp_path / "bom" / "doc.txt").write_bytes(b"\xef\xbb\xbfhello")
    sample = module(tmp_path / "bom", tmp_path, privacy_unit="document", val_fraction=0.0).train_dataset[0]
    assert bytes(sample["input_ids"][:5].tolist()) == b"hello"
    (tmp_path / "fields").mkdir()
    (tmp_path / "fields" / "a.jsonl").write_text('{"text": "one"}\n')
    (tmp_path / "fields" / "b.jsonl").write_text('{"text": "two", "meta": 1}\n')
    with pytest.raises(ValueError, match="column names don't match.*valid json file whose records all have the same"):
        module(tmp_path / "fields", tmp_path, privacy_unit="document", val_fraction=0.0)


@pytest.mark.parametrize("name, content", [("empty.txt", ""), ("empty.jsonl", ""), ("blank.jsonl", "\n  \n"),
                                           ("empty.json", "")])
def test_an_empty_file_is_refused_by_name(name, content, texts, tmp_path):
    """datasets fails on a file without records with a bare StopIteration (or "corresponds to no data")."""
    data = write(tmp_path / "data", texts[:3], "jsonl")
    (tmp_path / "data" / name).write_text(content)
    blank = "" if not content else r" \(only whitespace\)"
    with pytest.raises(ValueError, match=f"data_files file '.*{name}' is empty{blank}: it holds no document. Remove"
                                         " it from data_files .*or write text into it"):
        module(tmp_path / "data", tmp_path)
    with pytest.raises(ValueError, match=f"val_files file '.*{name}' is empty"):
        module(data, tmp_path, val_files=tmp_path / "data" / name)


def test_fit_refuses_a_tokenizer_larger_than_the_models_embedding(texts, tokenizer_dir, tmp_path):
    from lightning_longshield import CausalLMModule, LongShieldStrategy
    from tests.support.helpers import make_trainer, small_config

    data = LocalTextDataModule(write(tmp_path / "data", texts, "jsonl"), tokenizer=str(tokenizer_dir), seq_len=32,
                               val_fraction=0.0, cache_dir=tmp_path / "cache")
    model = CausalLMModule(small_config())  # vocab_size 64
    with pytest.raises(ValueError, match="tokenizer has 400 tokens but the model's embedding has 64 rows"):
        make_trainer(LongShieldStrategy(noise_multiplier=1.0), max_steps=1).fit(model, datamodule=data)


def test_unreadable_files_are_refused_by_name(texts, tmp_path):
    """A Latin-1 text and a parquet file with no rows: datasets' own errors named neither the file nor the fix."""
    data = write(tmp_path / "data", texts[:3], "txt")
    (tmp_path / "data" / "latin1.txt").write_bytes("caf\xe9 = 1\n".encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin1.txt is not UTF-8 text: re-encode it as UTF-8"):
        module(data, tmp_path)
    (tmp_path / "latin1.jsonl").write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(ValueError, match=r"latin1.jsonl is not UTF-8 text"):
        module(tmp_path / "latin1.jsonl", tmp_path)
    pq.write_table(pa.table({"text": pa.array([], type=pa.string())}), tmp_path / "rows.parquet")
    with pytest.raises(ValueError, match=r"data_files file '.*rows.parquet' is empty \(no rows\)"):
        module(tmp_path / "rows.parquet", tmp_path)
    (tmp_path / "array.json").write_text("[]")  # not blank, but no record: datasets said "corresponds to no data"
    with pytest.raises(ValueError, match=r"array.json holds no record that datasets can read"):
        module(tmp_path / "array.json", tmp_path)


def test_documents_without_an_eos_token_are_not_run_together(texts, tokenizer_dir, tmp_path):
    """A tokenizer without EOS: concatenated sequences would put labels across document boundaries (refused, with the
    fix); documents alone are only warned about."""
    tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_dir, local_files_only=True)
    tokenizer.eos_token = None
    data = write(tmp_path / "data", texts, "jsonl")
    with pytest.raises(ValueError, match="no EOS token .* eos_token .* or pass add_eos=False"):
        LocalTextDataModule(data, tokenizer=tokenizer, privacy_unit="sequence")
    with pytest.warns(UserWarning, match="no EOS token"):
        LocalTextDataModule(data, tokenizer=tokenizer, privacy_unit="document")
    LocalTextDataModule(data, tokenizer=tokenizer, privacy_unit="sequence", add_eos=False)


def test_an_empty_document_is_a_sample_without_labels():
    from lightning_longshield.local_text_data import PaddedDocumentDataset

    sample = PaddedDocumentDataset([[], [7]], seq_len=4, pad_id=0)[0]
    assert sample["input_ids"].tolist() == [0] * 4 and sample["labels"].tolist() == [IGNORE_INDEX] * 4


def test_a_validation_fraction_that_leaves_no_window_names_val_fraction(texts, tmp_path):
    data = write(tmp_path / "data", texts, "txt")
    with pytest.raises(ValueError, match=r"validation documents hold fewer tokens .* raise val_fraction \(now 0.1\)"):
        module(data, tmp_path, privacy_unit="sequence", seq_len=4096, val_fraction=0.1)
