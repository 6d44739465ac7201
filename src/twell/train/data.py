"""Training data: tokenizers, corpora and packed sequences.

Corpora (``--data``):

- ``stdlib`` (the default): the ``.py`` sources of the Python standard library of the running
  interpreter. Nothing is downloaded. Files are split into train and validation by a hash of
  their path, so the split is the same on every run and machine with that Python version.
- Local files or folders: ``.txt``/``.md``/``.py`` (one document per file), ``.jsonl`` (one
  document per line, field ``text``) and ``.parquet`` (column ``text``, needs pyarrow).
- ``hf:NAME[:CONFIG]``: a Hugging Face dataset (needs ``datasets`` and a network), streamed
  up to ``max_docs`` documents.

Every document gets a stable key: its path relative to the ``--data`` root it came from (the
folder given, the folder of a file given, or a glob's folder before its first wildcard), with
the row for ``.jsonl``/``.parquet``, so the key does not depend on whether the path was written
relative or absolute, nor on where the corpus lies. Documents go to validation when a hash of
their key falls under ``val_fraction``. Documents are tokenized, each followed
by the tokenizer's end-of-text id, and concatenated into one token stream per split. Training
samples are windows of ``seq_len + 1`` tokens cut from that stream at multiples of ``seq_len``,
visited in an order that is a seeded permutation per epoch: sample ``k`` depends only on
``(seed, k)``, so the data position of a run is one integer.
"""

from __future__ import annotations

import glob
import json
import sysconfig
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np
import torch

__all__ = [
    "ByteTokenizer",
    "HFTokenizer",
    "load_tokenizer",
    "iter_documents",
    "stdlib_documents",
    "is_validation",
    "build_streams",
    "PackedSequences",
]

TEXT_SUFFIXES = {".txt", ".md", ".py", ".rst"}


# --- tokenizers --------------------------------------------------------------------------------


class ByteTokenizer:
    """UTF-8 bytes as tokens 0..255, plus one end-of-text id (256). Needs no download.

    Round trip: ``decode(encode(s)) == s`` for every str ``s``.
    """

    name = "bytes"
    vocab_size = 257
    eos_id = 256

    def encode(self, text: str) -> np.ndarray:
        """str -> ``[n]`` uint16 ids (no end-of-text id appended)."""
        return np.frombuffer(text.encode("utf-8"), dtype=np.uint8).astype(np.uint16)

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> str; the end-of-text id becomes a newline, invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        return bytes(10 if i == self.eos_id else i for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        (Path(directory) / "twell_tokenizer.json").write_text(json.dumps({"type": "bytes"}))


class HFTokenizer:
    """A Hugging Face tokenizer (``AutoTokenizer``) by local path or hub name."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        self.name = name_or_path
        self.tok = AutoTokenizer.from_pretrained(name_or_path)
        self.vocab_size = len(self.tok)
        eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else self.tok.sep_token_id
        if eos is None:
            raise ValueError(f"tokenizer {name_or_path!r} has no eos or sep token to separate documents")
        self.eos_id = int(eos)

    def encode(self, text: str) -> np.ndarray:
        dtype = np.uint16 if self.vocab_size <= 65536 else np.int32
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=dtype)

    def decode(self, ids: Iterable[int]) -> str:
        return self.tok.decode([int(i) for i in ids])

    def save(self, directory: Path) -> None:
        self.tok.save_pretrained(directory)
        (Path(directory) / "twell_tokenizer.json").write_text(json.dumps({"type": "hf", "name": self.name}))


def load_tokenizer(spec: Optional[str]):
    """``None``/``"bytes"`` -> :class:`ByteTokenizer`; anything else -> :class:`HFTokenizer`.

    A folder holding ``twell_tokenizer.json`` (a checkpoint) loads the tokenizer saved there.
    """
    if spec is None or spec == "bytes":
        return ByteTokenizer()
    marker = Path(spec) / "twell_tokenizer.json"
    if marker.is_file():
        kind = json.loads(marker.read_text())["type"]
        return ByteTokenizer() if kind == "bytes" else HFTokenizer(spec)
    return HFTokenizer(spec)


# --- documents ---------------------------------------------------------------------------------


def stdlib_documents() -> Iterator[tuple[str, str]]:
    """``(key, text)`` for every ``.py`` file of the running interpreter's standard library,
    sorted by relative path (``key``). Third-party packages (site-packages) are left out."""
    root = Path(sysconfig.get_paths()["stdlib"])
    if not root.is_dir():
        raise FileNotFoundError(f"the standard library folder {root} does not exist; pass --data")
    files = sorted(
        (p.relative_to(root).as_posix(), p)
        for p in root.rglob("*.py")
        if not ({"site-packages", "dist-packages"} & set(p.parts)) and p.is_file()
    )
    for key, path in files:
        yield key, path.read_text(encoding="utf-8", errors="replace")


def _expand(spec: str) -> tuple[Path, list[Path]]:
    """``(root, files)`` of a local ``--data`` spec; documents are keyed on their path relative to ``root``."""
    path = Path(spec)
    if path.is_dir():
        return path, sorted(p for p in path.rglob("*") if p.is_file() and p.suffix in TEXT_SUFFIXES | {".jsonl", ".parquet"})
    matches = sorted(Path(p) for p in glob.glob(spec, recursive=True))
    if not matches:
        raise FileNotFoundError(f"--data {spec!r}: no such file, folder or glob match")
    if not glob.has_magic(spec):
        return path.parent, matches
    fixed = []
    for part in path.parts:
        if glob.has_magic(part):
            break
        fixed.append(part)
    return Path(*fixed) if fixed else Path("."), matches


def _key(path: Path, root: Path) -> str:
    try:
        return path.relative_to(root).as_posix()
    except ValueError:  # not under root (a glob with "..", say): the path as found
        return path.as_posix()


def _file_documents(path: Path, text_field: str, key: Optional[str] = None) -> Iterator[tuple[str, str]]:
    key = str(path) if key is None else key
    if path.suffix == ".jsonl":
        with open(path, encoding="utf-8") as fh:
            for i, line in enumerate(fh):
                if not line.strip():
                    continue
                row = json.loads(line)
                if text_field not in row:
                    raise ValueError(f"{path}:{i + 1}: expected a field {text_field!r}, the row has {sorted(row)}; see --text-field")
                yield f"{key}:{i}", row[text_field]
    elif path.suffix == ".parquet":
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ImportError("reading .parquet needs pyarrow: pip install 'twell[data]'") from err
        table = pq.read_table(path, columns=[text_field])
        for i, text in enumerate(table.column(text_field).to_pylist()):
            yield f"{key}:{i}", text or ""
    else:
        yield key, path.read_text(encoding="utf-8", errors="replace")


def _hf_documents(spec: str, text_field: str, max_docs: Optional[int]) -> Iterator[tuple[str, str]]:
    try:
        import datasets
    except ImportError as err:
        raise ImportError("hf:NAME needs the datasets package: pip install 'twell[data]'") from err
    name, _, config = spec[3:].partition(":")
    ds = datasets.load_dataset(name, config or None, split="train", streaming=True)
    for i, row in enumerate(ds):
        if max_docs is not None and i >= max_docs:
            break
        if text_field not in row:
            raise ValueError(f"{spec} row {i}: expected a field {text_field!r}, the row has {sorted(row)}; see --text-field")
        yield f"{spec}:{i}", row[text_field]


def iter_documents(specs: list[str], text_field: str = "text", max_docs: Optional[int] = None) -> Iterator[tuple[str, str]]:
    """``(key, text)`` of every document named by the ``--data`` specs, in a fixed order."""
    for spec in specs:
        if spec == "stdlib":
            yield from stdlib_documents()
        elif spec.startswith("hf:"):
            yield from _hf_documents(spec, text_field, max_docs)
        else:
            root, paths = _expand(spec)
            for path in paths:
                yield from _file_documents(path, text_field, _key(path, root))


def is_validation(key: str, val_fraction: float) -> bool:
    """Whether the document with this key belongs to validation: a stable hash (crc32) of the
    key, not Python's salted ``hash``, so the split is the same in every process."""
    return (zlib.crc32(key.encode("utf-8")) % 100_000) < val_fraction * 100_000


def build_streams(specs: list[str], tokenizer, val_fraction: float = 0.02, text_field: str = "text",
                  max_docs: Optional[int] = None) -> tuple[np.ndarray, np.ndarray]:
    """Tokenize the corpus into ``(train [n_train], validation [n_val])`` token streams.

    Each document is followed by ``tokenizer.eos_id``. If either side gets no document (one
    file, say), the split is by position instead: the last ``val_fraction`` of the stream of
    all documents becomes validation, the rest training.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    parts: dict[bool, list[np.ndarray]] = {False: [], True: []}
    eos = None
    for key, text in iter_documents(specs, text_field, max_docs):
        ids = tokenizer.encode(text)
        if eos is None:
            eos = np.array([tokenizer.eos_id], dtype=ids.dtype)
        parts[is_validation(key, val_fraction)] += [ids, eos]
    if not parts[False] and not parts[True]:
        raise ValueError(f"--data {' '.join(specs)}: found no documents; twell reads {' '.join(sorted(TEXT_SUFFIXES))} "
                         "files (a document per file), .jsonl (a document per line) and .parquet (a document per row)")
    train = np.concatenate(parts[False]) if parts[False] else np.zeros(0, np.uint16)
    val = np.concatenate(parts[True]) if parts[True] else np.zeros(0, np.uint16)
    if len(val) == 0 or len(train) == 0:
        stream = train if len(val) == 0 else val
        cut = min(max(int(len(stream) * (1.0 - val_fraction)), 1), len(stream) - 1)
        train, val = stream[:cut], stream[cut:]
    return train, val


# --- packed sequences --------------------------------------------------------------------------


@dataclass
class PackedSequences:
    """Windows of ``seq_len + 1`` tokens over one token stream, at multiples of ``seq_len``.

    ``sample(k)`` is the k-th training sample: epoch ``k // len(self)`` visits the windows in
    the order of ``randperm(len(self))`` drawn from a generator seeded with ``seed + epoch``.
    """

    tokens: np.ndarray
    seq_len: int
    seed: int = 0

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(
                f"the token stream has {len(self.tokens)} tokens, fewer than one sequence of "
                f"seq_len + 1 = {self.seq_len + 1}; use more data or a shorter --seq-len"
            )
        self._perm_epoch, self._perm = -1, None

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def window(self, i: int) -> np.ndarray:
        """The i-th window in stream order, ``[seq_len + 1]``."""
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def _order(self, epoch: int) -> np.ndarray:
        if epoch != self._perm_epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            self._perm, self._perm_epoch = torch.randperm(len(self), generator=g).numpy(), epoch
        return self._perm

    def batch(self, first: int, count: int) -> torch.Tensor:
        """Training samples ``first .. first + count - 1`` as ``[count, seq_len + 1]`` int64."""
        n = len(self)
        rows = [self.window(int(self._order(k // n)[k % n])) for k in range(first, first + count)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))

    def eval_batch(self, first: int, count: int) -> torch.Tensor:
        """Windows ``first ..`` in stream order (for validation; wraps around), ``[count, seq_len + 1]``."""
        rows = [self.window((first + j) % len(self)) for j in range(count)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))
