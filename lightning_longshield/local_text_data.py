"""Local text files (.txt, .jsonl/.json, .parquet) as causal-LM samples with an explicit privacy unit."""

from __future__ import annotations

import codecs
import glob
import hashlib
import itertools
import json
import os
import re
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal, Optional, Union

import lightning as L
import torch
from lightning.pytorch.utilities.rank_zero import rank_zero_warn
from torch.utils.data import DataLoader, Dataset

from lightning_longshield.code_digest import class_code_digest
from lightning_longshield.hf import require_hf
from lightning_longshield.loss import IGNORE_INDEX
from lightning_longshield.text_data import ByteTokenizer, PackedTokenDataset

PathLike = Union[str, "os.PathLike[str]"]
PrivacyUnit = Literal["sequence", "document"]
PRIVACY_UNITS = ("sequence", "document")
# Extension -> (datasets builder, what one document of such a file is).
FORMATS = {
    ".txt": ("text", "a .txt file"),
    ".jsonl": ("json", "a .jsonl line"),
    ".json": ("json", "a .json record"),
    ".parquet": ("parquet", "a .parquet row"),
}
BYTE_EOS = 0  # end of document for the byte-level tokenizer: the NUL byte, which text does not contain in practice


def resolve_data_files(data_files: Union[PathLike, Sequence[PathLike]]) -> list[Path]:
    """The files named by a path, a glob, a directory (its own supported files, not subdirectories; hidden files
    skipped) or a list of them, in order (globs and directories sorted), without duplicates: every name of one file
    (links, hard links included) counts once, or its documents would be samples twice."""
    entries = [data_files] if isinstance(data_files, (str, os.PathLike)) else list(data_files)
    if not entries:
        raise ValueError("data_files is empty: pass a file, a glob, a directory, or a list of them.")
    kinds = "/".join(FORMATS)
    files: list[Path] = []
    for entry in entries:
        path = Path(entry).expanduser()
        if path.is_dir():
            matched = sorted(
                p for p in path.iterdir() if p.is_file() and p.suffix.lower() in FORMATS and not p.name.startswith(".")
            )
        elif path.is_file():
            matched = [path]
        else:
            matched = sorted(Path(p) for p in glob.glob(str(path), recursive=True) if Path(p).is_file())
        if not matched:
            raise FileNotFoundError(
                f"No {kinds} files match data_files entry {str(entry)!r}: check the path (a file, a glob such as"
                " 'data/*.jsonl' or 'data/**/*.txt', or a directory)."
            )
        unsupported = [p.name for p in matched if p.suffix.lower() not in FORMATS]
        if unsupported:
            raise ValueError(
                f"Unsupported file type(s) {unsupported[:5]} in data_files entry {str(entry)!r}: use {kinds} files,"
                " or a glob that matches only those (e.g. 'data/*.jsonl')."
            )
        files.extend(matched)
    by_identity = {_file_identity(path): path.resolve() for path in reversed(files)}  # the first name kept
    return list(dict.fromkeys(by_identity[_file_identity(path)] for path in files))


def _file_identity(path: Path) -> tuple[int, int]:
    """The file behind ``path`` (device, inode): the same for every name of it, hard links included."""
    stat = path.stat()
    return stat.st_dev, stat.st_ino


def refuse_blank_files(files: Sequence[Path], argument: str = "data_files") -> None:
    """Raise a ValueError naming the first file of ``files`` that is empty or holds only whitespace (``datasets``
    would fail on it with a bare StopIteration or "corresponds to no data"). Reads only up to the first
    non-whitespace byte of each file."""
    for path in files:
        if path.suffix.lower() == ".parquet":
            blank = path.stat().st_size == 0 or _parquet_rows(path) == 0
        else:
            blank = True
            with open(path, "rb") as handle:
                while blank and (chunk := handle.read(1 << 16)):
                    blank = not chunk.strip()
        if blank:
            what = "" if path.stat().st_size == 0 else " (no rows)" if path.suffix.lower() == ".parquet" else \
                " (only whitespace)"
            raise ValueError(
                f"{argument} file {str(path)!r} is empty{what}: it holds no document. Remove it from {argument} (or"
                " from the directory or glob that matches it), or write text into it."
            )


def _parquet_rows(path: Path) -> Optional[int]:
    """The rows a parquet file's footer declares (``None`` where it cannot be read: `datasets` reports that)."""
    try:
        import pyarrow.parquet as pq

        return pq.ParquetFile(path).metadata.num_rows
    except Exception:  # not readable as parquet, or no pyarrow: left to the loader's own error
        return None


def _unreadable(paths: list[str], builder: str, error: BaseException) -> ValueError:
    """The error for files `datasets` could not read: the first that is not UTF-8, by name, else all of them."""
    undecodable = _first_file_not_utf8(paths) if builder != "parquet" else None
    if undecodable is not None:
        return ValueError(f"{undecodable} is not UTF-8 text: re-encode it as UTF-8 (e.g. iconv -f latin1 -t utf-8),"
                          " or remove it from the data.")
    cause = error.__cause__ or error.__context__
    why = f"{type(error).__name__}: {error}" + (f"; {type(cause).__name__}: {cause}" if cause is not None else "")
    fields = " whose records all have the same fields" if builder == "json" else ""
    return ValueError(f"datasets could not read {paths[0]}{' or another of these files' if len(paths) > 1 else ''}"
                      f" ({why}): check that each is a valid {builder} file{fields}.")


def _first_file_not_utf8(paths: Sequence[str]) -> Optional[str]:
    """The first of ``paths`` (text or JSON files) that is not valid UTF-8, read in chunks; ``None`` if all are."""
    for path in paths:
        decoder = codecs.getincrementaldecoder("utf-8")()
        try:
            with open(path, "rb") as handle:
                while chunk := handle.read(1 << 20):
                    decoder.decode(chunk)
            decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return path
    return None


class PaddedDocumentDataset(Dataset):
    """One causal-LM sample per document: its first ``seq_len + 1`` tokens, right-padded to ``seq_len``.

    ``documents`` holds token sequences, or rows ``{"input_ids": tokens}`` (such as a tokenized `datasets.Dataset`).

    With ``tokens`` the document's first ``seq_len + 1`` tokens, ``input_ids`` is ``tokens[:seq_len]`` then
    ``pad_id`` and ``labels[t]`` is ``tokens[t + 1]`` where that exists, else -100: a document of ``n`` tokens has
    ``min(n, seq_len + 1) - 1`` labelled positions, and its tokens past ``seq_len + 1`` are not used.
    """

    def __init__(self, documents: Sequence[Sequence[int]], seq_len: int, pad_id: int) -> None:
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
        self.documents, self.seq_len, self.pad_id = documents, seq_len, pad_id

    def __len__(self) -> int:
        return len(self.documents)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        document = self.documents[index]
        if isinstance(document, Mapping):
            document = document["input_ids"]
        tokens = torch.as_tensor(document[: self.seq_len + 1], dtype=torch.long)
        n = min(tokens.numel(), self.seq_len)
        input_ids = torch.full((self.seq_len,), self.pad_id, dtype=torch.long)
        labels = torch.full((self.seq_len,), IGNORE_INDEX, dtype=torch.long)
        input_ids[:n] = tokens[:n]
        labels[: max(tokens.numel() - 1, 0)] = tokens[1:]
        return {"input_ids": input_ids, "labels": labels}


#: Tokens past the ``keep`` a document's prefix must give before they are taken for its first ``keep`` (`_Encode`).
PREFIX_MARGIN = 64
#: Characters of text one ``datasets.map`` call tokenizes at most (whole documents: more where one is longer). A
#: Hugging Face tokenizer takes about 240 bytes of memory a character while it runs.
MAP_BATCH_CHARACTERS = 2**22
_WHITESPACE = re.compile(r"\s")


def _map_batch_size(paths: list[str], records: int) -> int:
    """Documents per ``datasets.map`` call: ``datasets``' 1,000, fewer where the files' documents average more than
    `MAP_BATCH_CHARACTERS` / 1,000 bytes (a folder of books), so that a call tokenizes about that much text."""
    average = sum(os.path.getsize(path) for path in paths) / max(records, 1)
    return max(1, min(1000, int(MAP_BATCH_CHARACTERS // max(average, 1.0))))


class _Encode:
    """Texts -> token ids for ``datasets.map``: the tokenizer's own special tokens (e.g. a BOS), then ``eos`` unless
    it is already last; an empty or missing text gives no tokens (the document is dropped).

    With ``keep`` (the document unit, which trains on a document's first ``keep`` tokens), a long document's first
    ``keep`` tokens are taken from a prefix cut before a whitespace character, at least `PREFIX_MARGIN` tokens past
    them, grown four-fold until it holds enough: a 9 MB text is not tokenized whole for its first 1,025 tokens. A
    tokenizer that splits words at whitespace before merging (Llama 3's and GPT-2's regular expressions, SentencePiece
    pieces that start at a space) gives the prefix the whole text's tokens up to its last word, so the tokens kept are
    the same; a text without whitespace past the prefix is tokenized whole."""

    def __init__(self, tokenizer: Any, eos: Optional[int], keep: Optional[int] = None) -> None:
        transformers = sys.modules.get("transformers")
        self.batched = transformers is not None and isinstance(tokenizer, transformers.PreTrainedTokenizerBase)
        self.tokenizer, self.eos, self.keep = tokenizer, eos, keep
        # Part of what `datasets` hashes into the cache's fingerprint: it pickles an object by its class's name and
        # its state, so without the code an edited `encode` (once reloaded), or this class's, would reuse old tokens.
        # A library's tokenizer class is versioned with the library; a user's own (a subclass included) is hashed.
        library = type(tokenizer).__module__.split(".")[0] in ("transformers", "tokenizers")
        self.code = class_code_digest(type(self)) + ("" if library else class_code_digest(type(tokenizer)))
        # A special token's text inside a document ("</s>", "<|eot_id|>") is text, not a control token. Only fast
        # tokenizers split special tokens alone: slow ones would split every added token, changing ordinary text.
        self.options = {"split_special_tokens": True} if getattr(tokenizer, "is_fast", False) else {}

    def __call__(self, texts: list[Optional[str]]) -> dict[str, list[list[int]]]:
        ids: list[list[int]] = [[] for _ in texts]
        whole = []  # the indices of the texts tokenized whole
        for i, text in enumerate(texts):
            if text:
                prefix = self._prefix_tokens(text)
                if prefix is None:
                    whole.append(i)
                else:
                    ids[i] = prefix
        for i, tokens in zip(whole, self._encode([texts[i] for i in whole]) if whole else []):
            ids[i] = self._end(list(tokens))[:self.keep]
        return {"input_ids": ids}

    def _encode(self, texts: list[str]) -> list[list[int]]:
        if self.batched:
            return self.tokenizer(texts, verbose=False, **self.options)["input_ids"]
        return [self.tokenizer.encode(text) for text in texts]

    def _prefix_tokens(self, text: str) -> Optional[list[int]]:
        """The first ``keep`` tokens of ``text`` from a prefix of it (the class's doc), or None where the whole text
        is to be tokenized."""
        if self.keep is None:
            return None
        length = 8 * (self.keep + PREFIX_MARGIN)  # about 4 characters a token in English text and code
        while length < len(text):
            space = _WHITESPACE.search(text, length)
            if space is None:
                return None
            cut = space.start()
            tokens = list(self._encode([text[:cut]])[0])
            if len(tokens) >= self.keep + PREFIX_MARGIN:
                return tokens[:self.keep]
            length = 4 * cut
        return None

    def _end(self, tokens: list[int]) -> list[int]:
        return tokens + [self.eos] if self.eos is not None and tokens[-1:] != [self.eos] else tokens


class LocalTextDataModule(L.LightningDataModule):
    """Causal-LM samples from local text files, with the privacy unit stated explicitly.

    Documents: a ``.txt`` file is one document; a ``.jsonl`` line, a ``.json`` record or a ``.parquet`` row is one
    document, its text in ``text_field``. Files are read with ``datasets.load_dataset`` (local files only) and
    tokenized with ``Dataset.map``; both are cached by ``datasets`` under ``cache_dir`` (default: its own cache), in
    a folder per version of the files, so a second run reuses the tokens and a changed file is read again. A custom
    tokenizer object is cached by its state and the code of its class and bases as loaded: after changing code
    outside them (a helper function it calls), pass a new ``cache_dir``.
    ``tokenizer`` is None (UTF-8 bytes, `ByteTokenizer`), a path to a saved Hugging
    Face tokenizer (``AutoTokenizer.from_pretrained(path, local_files_only=True)``) or an object with
    ``encode(text) -> list[int]`` and ``len()`` or ``vocab_size``. Each document is encoded with the tokenizer's own
    special tokens and, with ``add_eos``, ends with its EOS token (the byte-level tokenizer uses byte 0, NUL).
    Documents without text are dropped; ``max_documents`` keeps only the first ones read.

    Privacy unit (what one DP-SGD sample, and so the guarantee, covers):

    - ``"sequence"``: the training documents are concatenated and cut into disjoint windows of ``seq_len + 1``
      tokens (`PackedTokenDataset`); a window is the unit, so a document spanning several windows is protected only
      per window.
    - ``"document"``: one document is one sample (`PaddedDocumentDataset`), truncated to ``seq_len + 1`` tokens (the
      rest is not trained on) and padded with ``tokenizer.pad_token_id`` (else the EOS id, else 0) at -100 labels.

    Validation: none by default. The validation loss is logged without noise, so it must come from data that may
    be released: pass public documents as ``val_files`` (files, globs or directories like ``data_files``, read,
    tokenized and cut into samples the same way). ``val_fraction > 0`` instead holds out a seeded (``seed``)
    choice of that fraction of the private documents (at least one; whole documents, for both units) and warns:
    those documents are not trained on, so the DP guarantee, which covers the training set, does not protect them,
    yet their un-noised validation loss is released. Use it only if the held-out documents may be disclosed.
    ``batch_size`` is the training DataLoader's batch size, which `LongShieldStrategy` uses as the expected logical
    (privacy) batch.
    """

    def __init__(
        self,
        data_files: Union[PathLike, Sequence[PathLike]],
        text_field: str = "text",
        tokenizer: Any = None,
        seq_len: int = 1024,
        batch_size: int = 8,
        privacy_unit: PrivacyUnit = "sequence",
        val_fraction: float = 0.0,
        val_batch_size: Optional[int] = None,
        val_files: Union[PathLike, Sequence[PathLike], None] = None,
        cache_dir: Optional[PathLike] = None,
        num_proc: Optional[int] = None,
        max_documents: Optional[int] = None,
        add_eos: bool = True,
        seed: int = 0,
    ) -> None:
        super().__init__()
        if privacy_unit not in PRIVACY_UNITS:
            raise ValueError(f"privacy_unit must be 'sequence' or 'document', got {privacy_unit!r}.")
        if seq_len < 2:
            raise ValueError(f"seq_len must be >= 2, got {seq_len}.")
        for name, value in (("batch_size", batch_size), ("val_batch_size", val_batch_size), ("num_proc", num_proc),
                            ("max_documents", max_documents)):
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1{'' if name == 'batch_size' else ' or None'}, got {value}.")
        if not 0 <= val_fraction < 1:
            raise ValueError(f"val_fraction must be in [0, 1) (0: no validation set), got {val_fraction}.")
        if val_fraction and val_files is not None:
            raise ValueError("Pass val_files (public validation documents) or val_fraction (held out from data_files),"
                             " not both.")
        if val_fraction:
            rank_zero_warn(
                f"val_fraction={val_fraction} holds out that fraction of the private documents in data_files for"
                " validation. Their validation loss is logged without noise, and they are not trained on, so they are"
                " outside the training set that the DP guarantee covers: the released validation metrics are not"
                " differentially private for those documents. Pass public validation documents as val_files=..."
                " instead (and val_fraction=0), unless the held-out documents may be disclosed."
            )
        if not text_field or not isinstance(text_field, str):
            raise ValueError(f"text_field must be a column name, got {text_field!r}.")
        self.files = resolve_data_files(data_files)
        refuse_blank_files(self.files, "data_files")
        self.val_files = None if val_files is None else resolve_data_files(val_files)
        if self.val_files is not None:
            refuse_blank_files(self.val_files, "val_files")
            trained = {_file_identity(path) for path in self.files}  # a hard link is the same file
            shared = sorted(path for path in self.val_files if _file_identity(path) in trained)
            if shared:
                more = ", ..." if len(shared) > 1 else ""
                raise ValueError(
                    f"val_files and data_files share {len(shared)} file(s) ({shared[0]}{more}):"
                    " their documents would be trained on and their validation loss released without noise. Keep"
                    " the public validation files out of data_files (another folder, or a glob that leaves them out)."
                )
        self.tokenizer = self._load_tokenizer(tokenizer)
        self.text_field, self.seq_len, self.privacy_unit = text_field, seq_len, privacy_unit
        if add_eos and self.eos_token_id is None:
            eos = "set the tokenizer's eos_token (tokenizer.add_special_tokens({'eos_token': ...}))"
            if privacy_unit == "sequence":
                raise ValueError(f"The tokenizer has no EOS token to end each document with, so concatenated"
                                 f" documents would run into each other (labels across document boundaries): {eos},"
                                 " or pass add_eos=False to concatenate them as they are.")
            rank_zero_warn(f"The tokenizer has no EOS token, so documents do not end with one (add_eos=True): {eos},"
                           " or pass add_eos=False.")
        self.batch_size, self.val_batch_size = batch_size, val_batch_size or batch_size
        self.val_fraction, self.seed, self.add_eos = val_fraction, seed, add_eos
        self.cache_dir = None if cache_dir is None else os.fspath(cache_dir)
        self.num_proc, self.max_documents = num_proc, max_documents
        self.train_dataset: Optional[Dataset] = None
        self.val_dataset: Optional[Dataset] = None
        self.train_documents: list[int] = []  # indices of documents in reading order
        self.val_documents: list[int] = []
        self._tokenized: Any = None
        self._tokenized_val: Any = None

    @staticmethod
    def _load_tokenizer(tokenizer: Any) -> Any:
        if tokenizer is None:
            return ByteTokenizer()
        if isinstance(tokenizer, (str, os.PathLike)):
            auto = require_hf("transformers").AutoTokenizer
            directory = Path(tokenizer).expanduser()
            if directory.is_dir() and not (directory / "tokenizer_config.json").is_file():
                rank_zero_warn(
                    f"The tokenizer in {directory} has no tokenizer_config.json: transformers then guesses its class"
                    " and special tokens (a SentencePiece tokenizer.model alone is read without Llama 2's BOS <s>),"
                    " and the token ids can differ from those the checkpoint was trained on. Copy the checkpoint's"
                    " tokenizer_config.json beside it."
                )
            try:
                return auto.from_pretrained(os.fspath(directory), local_files_only=True)
            except OSError as error:
                if directory.exists():
                    raise
                # transformers takes a missing folder for a Hub repo id and speaks of the network or the id's form.
                raise FileNotFoundError(
                    f"No tokenizer folder at {directory} (nor a Hugging Face cache entry of that name: nothing is"
                    " downloaded). Pass the folder that holds the tokenizer's files (tokenizer.json or tokenizer.model,"
                    " with tokenizer_config.json), for example the checkpoint's own folder."
                ) from error
            except (ImportError, ValueError) as error:
                if not (directory / "tokenizer.model").is_file() or (directory / "tokenizer.json").is_file():
                    raise
                raise ValueError(
                    f"The tokenizer in {directory} is a SentencePiece model (tokenizer.model, no tokenizer.json), which"
                    " transformers reads with the sentencepiece and protobuf packages: pip install sentencepiece"
                    ' protobuf (both come with "lightning-longshield[hf]").'
                ) from error
        if not callable(getattr(tokenizer, "encode", None)) or not (
            hasattr(type(tokenizer), "__len__") or hasattr(tokenizer, "vocab_size")
        ):
            raise TypeError(
                f"tokenizer must be None (bytes), a path to a saved tokenizer, or an object with encode(text) ->"
                f" list[int] and len() or vocab_size; got {type(tokenizer).__name__}."
            )
        return tokenizer

    # ------------------------------------------------------------------ tokenizer facts

    @property
    def vocab_size(self) -> int:
        """Token ids lie in ``[0, vocab_size)``: ``len(tokenizer)`` (added tokens included), 256 for bytes."""
        tokenizer = self.tokenizer
        return len(tokenizer) if hasattr(type(tokenizer), "__len__") else int(tokenizer.vocab_size)

    @property
    def eos_token_id(self) -> Optional[int]:
        if isinstance(self.tokenizer, ByteTokenizer):
            return BYTE_EOS
        return getattr(self.tokenizer, "eos_token_id", None)

    @property
    def pad_token_id(self) -> int:
        """The input id at padded positions of ``"document"`` samples (their labels are -100)."""
        candidates = (getattr(self.tokenizer, "pad_token_id", None), self.eos_token_id)
        return next((i for i in candidates if i is not None), 0)

    def check_vocab(self, model_vocab_size: int) -> None:
        """Raise if the tokenizer can emit ids that the model's embedding (``model_vocab_size`` rows) lacks."""
        if self.vocab_size > model_vocab_size:
            raise ValueError(
                f"The tokenizer has {self.vocab_size} tokens but the model's embedding has {model_vocab_size} rows:"
                f" use a model config with vocab_size >= {self.vocab_size}, or the tokenizer the model was built for."
            )

    def describe_privacy_unit(self) -> str:
        """What one sample is, in words: the unit the privacy guarantee protects."""
        if self.privacy_unit == "document":
            kinds = " or ".join(dict.fromkeys(FORMATS[p.suffix.lower()][1] for p in self.files))
            return f"one document ({kinds}), truncated to {self.seq_len + 1} tokens"
        return (
            f"one sequence of {self.seq_len + 1} tokens of concatenated documents; a document spanning"
            " several sequences is protected only per sequence"
        )

    # ------------------------------------------------------------------ data

    def prepare_data(self) -> None:
        self._tokenize()
        self._tokenize_validation()

    def _tokenize(self) -> Any:
        """All documents of ``data_files`` as a ``datasets.Dataset`` with one ``input_ids`` column (int32), in reading
        order."""
        if self._tokenized is None:
            self._tokenized = self._tokenize_files(self.files, self.max_documents)
        return self._tokenized

    def _tokenize_validation(self) -> Any:
        """The documents of ``val_files`` like `_tokenize`'s (None without ``val_files``)."""
        if self._tokenized_val is None and self.val_files is not None:
            self._tokenized_val = self._tokenize_files(self.val_files, None)
        return self._tokenized_val

    def _tokenize_files(self, files: list[Path], max_documents: Optional[int]) -> Any:
        datasets = require_hf("datasets")
        features = datasets.Features({"input_ids": datasets.Sequence(datasets.Value("int32"))})
        keep = self.seq_len + 1 if self.privacy_unit == "document" else None
        encode = _Encode(self.tokenizer, self.eos_token_id if self.add_eos else None, keep)
        parts, remaining = [], max_documents
        for builder, group in itertools.groupby(files, key=lambda p: FORMATS[p.suffix.lower()][0]):
            paths = [str(p) for p in group]
            try:
                raw = datasets.load_dataset(
                    builder, data_files=paths, split="train", cache_dir=self._files_cache_dir(paths, datasets),
                    num_proc=self.num_proc,
                    **({"sample_by": "document", "encoding": "utf-8-sig"} if builder == "text" else {}),  # no BOM
                )
            except (StopIteration, ValueError) as error:  # what `datasets` raises for files without records
                if isinstance(error, ValueError) and "corresponds to no data" not in str(error):
                    raise
                raise ValueError(
                    f"{paths[0]}{' (or another of these files)' if len(paths) > 1 else ''} holds no record that"
                    f" datasets can read: check that each is a valid {builder} file with documents in it, and remove"
                    " empty files from the data."
                ) from error
            except (UnicodeDecodeError, datasets.exceptions.DatasetGenerationError) as error:
                raise _unreadable(paths, builder, error) from error
            field = "text" if builder == "text" else self.text_field
            if field not in raw.column_names:
                raise ValueError(
                    f"{paths[0]}{' (and others)' if len(paths) > 1 else ''} has no field {field!r}; its fields are"
                    f" {raw.column_names}: pass text_field=<the one holding the text>."
                )
            if getattr(raw.features[field], "dtype", None) not in ("string", "large_string"):
                raise ValueError(f"Field {field!r} of {paths[0]} holds {raw.features[field]}, not text.")
            if remaining is not None:
                raw = raw.select(range(min(remaining, len(raw))))
                remaining -= len(raw)
            try:
                parts.append(raw.map(
                    encode, batched=True, input_columns=[field], remove_columns=raw.column_names, features=features,
                    num_proc=self.num_proc, desc="Tokenizing", batch_size=_map_batch_size(paths, len(raw)),
                ))
            except UnicodeDecodeError as error:  # a JSON file's strings are decoded only when read
                raise _unreadable(paths, builder, error) from error
            if remaining == 0:
                break
        return parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)

    def _files_cache_dir(self, paths: list[str], datasets: Any) -> str:
        """A cache folder per version of ``paths``: `datasets` keys local files by their modification time alone, so
        a file rewritten with its time kept (``cp -p``, ``rsync -a``, unpacking an archive) would train on its old
        tokens, e.g. records deleted from it. Its size, inode and change time (which no copy can set) name the
        folder, with this library's version."""
        from lightning_longshield import __version__

        stats = [(path, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino) for path in paths
                 for st in [os.stat(path)]]
        digest = hashlib.sha256(json.dumps([__version__, stats]).encode()).hexdigest()[:16]
        return os.path.join(self.cache_dir or datasets.config.HF_DATASETS_CACHE, f"longshield-{digest}")

    def setup(self, stage: Optional[str] = None) -> None:
        if self.train_dataset is not None:
            return
        tokenized = self._tokenize()
        documents = torch.tensor(_non_empty(tokenized), dtype=torch.long)
        if documents.numel() == 0:
            raise ValueError(
                f"No text in {len(self.files)} file(s) ({self.files[0]}, ...): every document is empty. Check the"
                f" files and text_field={self.text_field!r}."
            )
        val_count = max(1, round(documents.numel() * self.val_fraction)) if self.val_fraction else 0
        if val_count >= documents.numel():
            raise ValueError(
                f"{documents.numel()} document(s) cannot be split into training and validation documents: add"
                " documents (a .txt file is one document; split large texts into several files or use .jsonl lines),"
                " or pass val_fraction=0 for no validation set."
            )
        order = documents[torch.randperm(documents.numel(), generator=torch.Generator().manual_seed(self.seed))]
        self.val_documents = sorted(order[:val_count].tolist())
        self.train_documents = sorted(order[val_count:].tolist())
        self.train_dataset = self._samples(tokenized.select(self.train_documents), "training")
        self.train_dataset.split_digest = self._split_digest()  # type: ignore[attr-defined]
        self.val_dataset = self._samples(tokenized.select(self.val_documents), "validation") if val_count else None
        public = self._tokenize_validation()
        if public is not None:
            kept = _non_empty(public)
            if not kept:
                raise ValueError(f"No text in the {len(self.val_files)} val_files ({self.val_files[0]}, ...): every"
                                 f" document is empty. Check the files and text_field={self.text_field!r}.")
            self.val_dataset = self._samples(public.select(kept), "validation")

    def _split_digest(self) -> str:
        """The settings that choose the training documents (the training dataset's ``split_digest``, which a resume
        compares and the checkpoint keeps): the files' names, ``seed``, ``val_fraction``, ``max_documents`` and the
        number of documents, hashed. Only public settings: the files' sizes, or which documents are empty, are
        values of the private data, and would tell two datasets that differ in one document apart."""
        settings = [[path.name for path in self.files], self.seed, self.val_fraction, self.max_documents,
                    len(self.train_documents) + len(self.val_documents)]
        return hashlib.sha256(json.dumps(settings).encode()).hexdigest()

    def _samples(self, documents: Any, split: str) -> Dataset:
        if self.privacy_unit == "document":
            return PaddedDocumentDataset(documents.with_format("numpy"), self.seq_len, self.pad_token_id)
        import pyarrow.compute as pc

        tokens = torch.tensor(pc.list_flatten(documents.with_format("arrow")[:].column("input_ids")).to_numpy())
        if tokens.numel() < self.seq_len + 1:
            raise ValueError(
                f"The {split} documents hold fewer tokens than one window of seq_len + 1 = {self.seq_len + 1}: add"
                " text, lower seq_len" + self._more_validation_text(split)
            )
        return PackedTokenDataset(tokens, self.seq_len)

    def _more_validation_text(self, split: str) -> str:
        if split != "validation":
            return "."
        if self.val_files is None:
            return f", or raise val_fraction (now {self.val_fraction}) so that the held-out documents fill a window."
        return ", or add validation documents."

    def train_dataloader(self) -> DataLoader:
        if self.train_dataset is None:
            raise RuntimeError("Call setup() before asking for a DataLoader.")
        return DataLoader(self.train_dataset, batch_size=self.batch_size, shuffle=True)

    def val_dataloader(self) -> Union[DataLoader, list]:
        """The validation DataLoader; an empty list (no validation) without ``val_files`` or ``val_fraction``."""
        if self.train_dataset is None:
            raise RuntimeError("Call setup() before asking for a DataLoader.")
        return [] if self.val_dataset is None else DataLoader(self.val_dataset, batch_size=self.val_batch_size)


def _non_empty(tokenized: Any) -> list[int]:
    """Indices of the documents of a tokenized ``datasets.Dataset`` that hold at least one token."""
    import pyarrow.compute as pc

    lengths = pc.list_value_length(tokenized.data.column("input_ids")).to_pylist()
    return [i for i, n in enumerate(lengths) if n]
