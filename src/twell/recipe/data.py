"""Training data: tokenizers, corpora and packed sequences.

Corpora (``--data``):

- ``stdlib`` (the default): the ``.py`` sources of the Python standard library of the running
  interpreter. Nothing is downloaded. Files are split into train and validation by a hash of
  their path, so the split is the same on every run and machine with that Python version.
- Local files or folders: ``.txt``/``.md``/``.py`` (one document per file), ``.jsonl`` (one
  document per line, field ``text``) and ``.parquet`` (column ``text``, needs pyarrow).
- ``hf:NAME[:CONFIG]``: a Hugging Face dataset (needs ``datasets`` and a network), streamed
  up to ``max_docs`` documents.
- A folder written by ``twell data prepare`` (recognised by its ``twell_corpus.json``): token
  shards on disk, read window by window (see :mod:`twell.recipe.shards`); for corpora too large
  to tokenize at start-up or to hold in memory.

Every document gets a stable key: its path relative to the ``--data`` root it came from (the
folder given, the folder of a file given, or a glob's folder before its first wildcard), with
the row for ``.jsonl``/``.parquet``, so the key does not depend on whether the path was written
relative or absolute, nor on where the corpus lies. Documents go to validation when a hash of
their key falls under ``val_fraction``. Documents are tokenized, each followed
by the tokenizer's end-of-text id, and concatenated into one token stream per split. Training
samples are windows of ``seq_len + 1`` tokens cut from that stream at multiples of ``seq_len``,
visited in an order that is a seeded permutation per epoch: sample ``k`` depends only on
``(seed, k)``, so the data position of a run is one integer. Raw corpora draw that permutation
with ``torch.randperm``; prepared ones compute it window by window with a keyed Feistel network
(:func:`feistel_permute`), so that it needs no memory proportional to the corpus.
:class:`Prefetcher` builds a rank's coming micro-batches in a background thread.
"""

from __future__ import annotations

import atexit
import functools
import glob
import json
import queue
import sysconfig
import threading
import time
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
    "feistel_permute",
    "corpus_tokenizer",
    "load_corpus",
    "Prefetcher",
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

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text."""
        return [self.encode(t) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        """ids -> str; the end-of-text id becomes a newline, invalid UTF-8 becomes U+FFFD."""
        ids = [int(i) for i in ids]
        return bytes(10 if i == self.eos_id else i for i in ids).decode("utf-8", errors="replace")

    def save(self, directory: Path) -> None:
        """``twell_tokenizer.json`` (what :func:`load_tokenizer` reads back) and the same tokenizer
        as Hugging Face files (``tokenizer.json``, ``tokenizer_config.json``), so that
        ``AutoTokenizer.from_pretrained(directory)`` gives these ids too."""
        (Path(directory) / "twell_tokenizer.json").write_text(json.dumps({"type": "bytes"}))
        self.as_hf().save_pretrained(directory)

    def as_hf(self):
        """This tokenizer as a ``transformers`` fast tokenizer: byte ``b`` is id ``b`` and
        ``<|endoftext|>`` is :attr:`eos_id`, so it encodes and decodes as :meth:`encode` and
        :meth:`decode` do (built with the ``tokenizers`` library: a byte-level BPE with no merges).

        >>> tok = ByteTokenizer().as_hf()
        >>> tok("h\u00e9")["input_ids"], tok.eos_token_id
        ([104, 195, 169], 256)
        """
        from tokenizers import Tokenizer, decoders, models, pre_tokenizers
        from transformers import PreTrainedTokenizerFast

        # GPT-2's byte-to-character table, which the ByteLevel pre-tokenizer applies: printable
        # bytes stand for themselves, the others for the characters from U+0100 on, in byte order
        printable = [*range(ord("!"), ord("~") + 1), *range(ord("\u00a1"), ord("\u00ac") + 1),
                     *range(ord("\u00ae"), ord("\u00ff") + 1)]
        others = [b for b in range(256) if b not in printable]
        char_of = {**{b: chr(b) for b in printable}, **{b: chr(256 + i) for i, b in enumerate(others)}}
        tok = Tokenizer(models.BPE(vocab={char_of[b]: b for b in range(256)}, merges=[]))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
        tok.decoder = decoders.ByteLevel()
        tok.add_special_tokens(["<|endoftext|>"])
        return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>")


class HFTokenizer:
    """A Hugging Face tokenizer (``AutoTokenizer``) by local path or hub name."""

    def __init__(self, name_or_path: str):
        from transformers import AutoTokenizer

        self.name = name_or_path
        try:
            self.tok = AutoTokenizer.from_pretrained(name_or_path)
        except (OSError, ValueError) as err:  # not on the hub, no network and not cached, a folder without one
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"tokenizer {name_or_path!r} could not be loaded: {first} (a local folder, or a hub name "
                             "with network access or in the local cache)") from err
        self.vocab_size = len(self.tok)
        eos = self.tok.eos_token_id if self.tok.eos_token_id is not None else self.tok.sep_token_id
        if eos is None:
            raise ValueError(f"tokenizer {name_or_path!r} has no eos or sep token to separate documents")
        self.eos_id = int(eos)

    @property
    def _dtype(self):
        return np.uint16 if self.vocab_size <= 65536 else np.int32

    def encode(self, text: str) -> np.ndarray:
        return np.asarray(self.tok(text, add_special_tokens=False)["input_ids"], dtype=self._dtype)

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        """``encode`` of each text, in one call (a fast tokenizer encodes the batch in Rust)."""
        if not texts:
            return []
        return [np.asarray(ids, dtype=self._dtype) for ids in self.tok(texts, add_special_tokens=False)["input_ids"]]

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
        try:
            kind = json.loads(marker.read_text())["type"]
        except (ValueError, KeyError) as err:
            raise ValueError(f"{marker}: not a twell tokenizer file ({type(err).__name__}: {err})") from err
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

    ``sample(k)`` is the k-th training sample: epoch ``k // len(self)`` visits the windows in a
    seeded order. ``order="randperm"`` (raw corpora): ``randperm(len(self))`` drawn from a
    generator seeded with ``seed + epoch``, held in memory for the current epoch.
    ``order="feistel"`` (prepared corpora): :func:`feistel_permute` keyed on ``(seed, epoch)``,
    computed per window, so nothing proportional to the corpus is held.

    ``tokens`` is a 1-D array, or any object with ``len`` and slicing that returns one (a
    prepared split's :class:`twell.recipe.shards.ShardedTokens`). Safe to read from several
    threads at once.
    """

    tokens: np.ndarray
    seq_len: int
    seed: int = 0
    order: str = "randperm"

    def __post_init__(self):
        if self.seq_len < 1:
            raise ValueError(f"seq_len must be >= 1, got {self.seq_len}")
        if self.order not in ("randperm", "feistel"):
            raise ValueError(f"order must be 'randperm' or 'feistel', got {self.order!r}")
        if len(self.tokens) < self.seq_len + 1:
            raise ValueError(
                f"the token stream has {len(self.tokens)} tokens, fewer than one sequence of "
                f"seq_len + 1 = {self.seq_len + 1}; use more data or a shorter --seq-len"
            )
        # (epoch, permutation) in one attribute: replaced whole, so that a thread never sees
        # one epoch's number with another epoch's permutation.
        self._perm_cache: tuple[int, Optional[np.ndarray]] = (-1, None)
        self._ids_cache: tuple[int, Optional[np.ndarray]] = (-1, None)  # (block, window ids): Feistel order

    def __len__(self) -> int:
        return (len(self.tokens) - 1) // self.seq_len

    def window(self, i: int) -> np.ndarray:
        """The i-th window in stream order, ``[seq_len + 1]``."""
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]

    def _order(self, epoch: int) -> np.ndarray:
        cached = self._perm_cache
        if cached[0] != epoch:
            g = torch.Generator().manual_seed(self.seed + epoch)
            cached = (epoch, torch.randperm(len(self), generator=g).numpy())
            self._perm_cache = cached
        return cached[1]

    def window_ids(self, first: int, count: int) -> np.ndarray:
        """Stream-order indices of the windows of training samples ``first .. first + count - 1``, int64 ``[count]``."""
        if self.order == "randperm":
            return self._window_ids(first, count)
        # Feistel: computed for aligned blocks of samples and the last block kept, since numpy's
        # cost per call, not per element, dominates at a micro-batch's size.
        parts, k, stop = [], first, first + count
        while k < stop:
            block = k // ID_BLOCK
            cached = self._ids_cache
            if cached[0] != block:
                cached = (block, self._window_ids(block * ID_BLOCK, ID_BLOCK))
                self._ids_cache = cached
            end = min(stop, (block + 1) * ID_BLOCK)
            parts.append(cached[1][k - block * ID_BLOCK : end - block * ID_BLOCK])
            k = end
        return np.concatenate(parts) if len(parts) != 1 else parts[0].copy()

    def _window_ids(self, first: int, count: int) -> np.ndarray:
        n = len(self)
        k = np.arange(first, first + count, dtype=np.int64)
        epochs, pos = k // n, k % n
        ids = np.empty(count, dtype=np.int64)
        for epoch in np.unique(epochs).tolist():
            here = epochs == epoch
            if self.order == "randperm":
                ids[here] = self._order(epoch)[pos[here]]
            else:
                ids[here] = feistel_permute(pos[here], n, self.seed, epoch)
        return ids

    def batch(self, first: int, count: int) -> torch.Tensor:
        """Training samples ``first .. first + count - 1`` as ``[count, seq_len + 1]`` int64."""
        ids = self.window_ids(first, count)
        if hasattr(self.tokens, "gather"):  # shards on disk: all rows in one call
            rows = self.tokens.gather(ids * self.seq_len, self.seq_len + 1)
        else:
            rows = np.stack([self.window(int(i)) for i in ids])
        return torch.from_numpy(rows.astype(np.int64))

    def eval_batch(self, first: int, count: int) -> torch.Tensor:
        """Windows ``first ..`` in stream order (for validation; wraps around), ``[count, seq_len + 1]``."""
        rows = [self.window((first + j) % len(self)) for j in range(count)]
        return torch.from_numpy(np.stack(rows).astype(np.int64))


# --- an order of windows that needs no memory ---------------------------------------------------

_MASK64 = (1 << 64) - 1
FEISTEL_ROUNDS = 6
ID_BLOCK = 4096  # samples whose window ids PackedSequences computes at once in Feistel order


def _splitmix64(x: int) -> int:
    """splitmix64's output function on a Python int: a well-mixed 64-bit hash of ``x``."""
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _mix(x: np.ndarray) -> np.ndarray:
    """The same mixing on a uint64 array (numpy array products wrap modulo 2^64)."""
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def feistel_permute(i: np.ndarray, n: int, seed: int = 0, epoch: int = 0) -> np.ndarray:
    """Where a pseudo-random permutation of ``range(n)``, keyed on ``(seed, epoch)``, sends ``i``.

    ``i``: int array ``[m]`` of values in ``[0, n)``; returns int64 ``[m]``. For a fixed key,
    ``feistel_permute(np.arange(n), n, ...)`` is a permutation of ``range(n)``. Memory and time
    are O(m), whatever ``n``: a balanced Feistel network of :data:`FEISTEL_ROUNDS` rounds
    permutes ``[0, 4**h)`` (the smallest such range holding ``n``), and values that land at
    ``n`` or above are sent through it again until they fall inside (cycle walking: the
    restriction of a permutation's cycles to ``range(n)`` is a permutation of it; at most 4
    passes on average since ``4**h < 4 n``).
    """
    i = np.asarray(i, dtype=np.int64)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if i.size and (int(i.min()) < 0 or int(i.max()) >= n):
        raise ValueError(f"indices must lie in [0, {n})")
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    shift, mask = np.uint64(half), np.uint64((1 << half) - 1)
    key = _splitmix64(_splitmix64(seed & _MASK64) ^ epoch)
    keys = [np.uint64(_splitmix64(key + r)) for r in range(FEISTEL_ROUNDS)]

    def rounds(x: np.ndarray) -> np.ndarray:
        left, right = x >> shift, x & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        return (left << shift) | right

    y = rounds(i.astype(np.uint64))
    outside = y >= np.uint64(n)
    while outside.any():
        y[outside] = rounds(y[outside])
        outside = y >= np.uint64(n)
    return y.astype(np.int64)


# --- prefetching --------------------------------------------------------------------------------


def next_first(first: int, batch_size: int, grad_accum: int, rank: int, world: int) -> int:
    """The first sample of a rank's micro-batch after the one that starts at sample ``first``.

    The trainer's layout: a step takes ``batch_size * grad_accum * world`` samples; within the
    step that starts at sample ``s``, micro-batch ``m`` of rank ``r`` is the ``batch_size``
    samples from ``s + (m * world + r) * batch_size``. So the ranks' micro-batches of a step
    are disjoint and together cover the step's samples, however they are split.
    """
    per_step, per_micro = batch_size * grad_accum * world, batch_size * world
    step_start = first - first % per_step
    micro = (first - step_start) // per_micro
    if micro + 1 < grad_accum:
        return first + per_micro
    return step_start + per_step + rank * batch_size


def _build(data: PackedSequences, first: int, count: int, pin: bool) -> torch.Tensor:
    batch = data.batch(first, count)
    return batch.pin_memory() if pin else batch


def _produce(data: PackedSequences, first: int, count: int, pin: bool, advance, out: queue.Queue,
             stop: threading.Event) -> None:
    """The prefetch thread: ``(first, batch)`` for ``first``, ``advance(first)``, ... into ``out``
    until ``stop`` is set; an exception is passed on as the batch and ends the thread."""
    while not stop.is_set():
        try:
            item = (first, _build(data, first, count, pin))
        except BaseException as err:  # handed to the consumer, which raises it
            item = (first, err)
        while not stop.is_set():
            try:
                out.put(item, timeout=0.1)  # wakes up to see stop
                break
            except queue.Full:
                continue
        if isinstance(item[1], BaseException):
            return
        first = advance(first)


# Every running prefetch thread, as (stop event, thread), so that interpreter exit can stop them.
_LIVE: "set[tuple[threading.Event, threading.Thread]]" = set()
_LIVE_LOCK = threading.Lock()


@atexit.register
def _stop_all() -> None:
    """Stop every prefetch thread and wait for it, before the interpreter finalizes. A daemon
    thread that is inside a torch op (the GIL released) when finalization starts is ended by
    CPython with pthread_exit as it takes the GIL back, and that unwinding through C++ frames
    calls std::terminate: "terminate called without an active exception", exit status -6, after
    the script's last line (seen, now and then, in a test whose script ended without closing its
    Prefetcher while the thread was still building batches ahead)."""
    with _LIVE_LOCK:
        live = list(_LIVE)
        _LIVE.clear()
    for stop, _ in live:
        stop.set()
    for _, thread in live:
        thread.join(timeout=10)


class Prefetcher:
    """One rank's training micro-batches, built ahead of need in a background thread.

    ``batch(first)`` returns what ``data.batch(first, batch_size)`` returns (pinned when
    ``pin``), ``[batch_size, seq_len + 1]`` int64. While the requests follow this rank's
    schedule (:func:`next_first`), the thread has built them already, keeping up to ``depth``
    ready in a bounded queue. A request for another position of the schedule (the first one,
    a resumed run's) restarts the thread there; one off the schedule is built on the spot.
    The data need not be read ahead from the start: each rank reads only its own samples'
    windows. ``wait_s`` adds up the seconds ``batch`` spent waiting for the thread.
    """

    def __init__(self, data: PackedSequences, batch_size: int, grad_accum: int = 1, rank: int = 0, world: int = 1,
                 depth: int = 4, pin: bool = False):
        if not 0 <= rank < world:
            raise ValueError(f"rank must be in [0, {world}), got {rank}")
        self.data, self.batch_size, self.pin, self.depth = data, batch_size, pin, depth
        self._advance = functools.partial(next_first, batch_size=batch_size, grad_accum=grad_accum, rank=rank, world=world)
        self._per_step, self._per_micro, self._offset = batch_size * grad_accum * world, batch_size * world, rank * batch_size
        self._expected: Optional[int] = None  # the first sample of the batch at the head of the queue
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(depth)
        self.wait_s = 0.0

    def on_schedule(self, first: int) -> bool:
        """Whether sample ``first`` starts one of this rank's micro-batches."""
        return first >= 0 and (first % self._per_step) % self._per_micro == self._offset

    def batch(self, first: int) -> torch.Tensor:
        """Samples ``first .. first + batch_size - 1``, ``[batch_size, seq_len + 1]`` int64."""
        if not self.on_schedule(first):
            return _build(self.data, first, self.batch_size, self.pin)
        if first != self._expected:
            self._start(first)
        t0 = time.perf_counter()
        got, item = self._queue.get()
        self.wait_s += time.perf_counter() - t0
        if isinstance(item, BaseException):
            self._expected = None
            raise item
        assert got == first, (got, first)
        self._expected = self._advance(first)
        return item

    def _start(self, first: int) -> None:
        self.close()
        # A fresh event and queue: the old thread may still hold the old ones for a moment.
        self._stop, self._queue = threading.Event(), queue.Queue(self.depth)
        # The thread gets no reference to self, so that dropping the Prefetcher stops it (__del__).
        self._thread = threading.Thread(
            target=_produce, name="twell-prefetch", daemon=True,
            args=(self.data, first, self.batch_size, self.pin, self._advance, self._queue, self._stop))
        with _LIVE_LOCK:
            _LIVE.add((self._stop, self._thread))
        self._thread.start()
        self._expected = first

    def close(self) -> None:
        """Stop the thread (a later ``batch`` starts a new one)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            with _LIVE_LOCK:
                _LIVE.discard((self._stop, self._thread))
        self._thread, self._expected = None, None

    def __del__(self):
        stop, thread = getattr(self, "_stop", None), getattr(self, "_thread", None)
        if stop is not None:
            stop.set()
        if thread is not None and _LIVE_LOCK is not None:  # None: the module is being torn down
            with _LIVE_LOCK:
                _LIVE.discard((stop, thread))
