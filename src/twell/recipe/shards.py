"""Prepared corpora: a corpus tokenized once (``twell data prepare``) into token shards on disk.

A prepared folder::

    DIR/
      twell_corpus.json        the index (below); written last, so a folder without it is no corpus
      train-00000.bin          tokens of whole documents, each followed by the end-of-text id:
      train-00001.bin ...      raw little-endian uint16 (vocabulary <= 65536) or uint32, so
                               np.memmap(path, dtype) opens one
      train-00000.docs.npy     int64 [documents + 1]: where each document starts in the shard, then its end
      validation-00000.bin, validation-00000.docs.npy, ...
      twell_tokenizer.json (+ a Hugging Face tokenizer's files)   load_tokenizer(DIR) loads it

The index (JSON)::

    {"format": "twell-corpus", "version": 1, "dtype": "uint16",
     "tokenizer": {"spec": "bytes", "name": "bytes", "vocab_size": 257, "eos_id": 256},
     "sources": ["corpus/"], "text_field": "text", "max_docs": null, "val_fraction": 0.02,
     "documents": 1234, "tokens": 5678901,
     "splits": {"train": {"split_by": "key", "documents": 1210, "start": 0, "stop": 5570000,
                          "shards": [{"file": "train-00000.bin", "docs": "train-00000.docs.npy",
                                      "offset": 0, "tokens": 5570000, "documents": 1210}]},
                "validation": {...}}}

A split is the token range ``[start, stop)`` of its shards laid end to end (``offset``: where a
shard starts in that stream). Documents go to validation by :func:`twell.recipe.data.is_validation`
of the same keys as the raw path's, so a prepared corpus splits exactly like its raw files; and
as there, when either side would get no document the split is by position instead
(``split_by: "position"``): both splits then share the shards, validation being the last
``val_fraction`` of the tokens.

Reading (:class:`ShardedTokens`) uses ``os.pread`` on the shard files: a window costs one or
two reads, nothing is mapped, and the reader's memory is one open file per shard, whatever
the corpus size (touched pages of a memory map would count towards the process's resident
memory, up to the whole corpus over an epoch).
"""

from __future__ import annotations

import array
import json
import multiprocessing
import os
import shutil
import sys
import time
from collections import deque
from pathlib import Path
from typing import Iterable, Iterator, Optional

import numpy as np

from .data import ByteTokenizer, PackedSequences, is_validation, iter_documents, load_tokenizer

__all__ = ["INDEX_NAME", "ShardWriter", "ShardedTokens", "PreparedCorpus", "prepared_corpus", "prepare_corpus",
           "finish_corpus", "token_dtype"]

INDEX_NAME = "twell_corpus.json"
FORMAT, VERSION = "twell-corpus", 1


def token_dtype(vocab_size: int) -> np.dtype:
    """Little-endian uint16 when every id fits (vocab_size <= 65536), else uint32."""
    return np.dtype("<u2") if vocab_size <= 65536 else np.dtype("<u4")


# --- writing -----------------------------------------------------------------------------------


class ShardWriter:
    """Appends whole documents to one split's shard files, ``SPLIT-00000.bin``, ``SPLIT-00001.bin``, ...

    A shard is closed after the document that brings it to ``shard_tokens`` tokens or more,
    so shards hold whole documents (a document longer than ``shard_tokens`` fills one alone).
    Memory: the current shard's document starts (8 bytes per document).
    """

    def __init__(self, folder: Path, split: str, dtype: np.dtype, shard_tokens: int):
        if shard_tokens < 1:
            raise ValueError(f"shard_tokens must be >= 1, got {shard_tokens}")
        self.folder, self.split, self.dtype, self.shard_tokens = Path(folder), split, np.dtype(dtype), shard_tokens
        self.shards: list[dict] = []
        self.tokens = 0  # written to this split so far
        self._fh = None
        self._n = 0  # tokens in the open shard
        self._starts = array.array("q")  # document starts in the open shard

    def add(self, tokens: np.ndarray, lengths: np.ndarray) -> None:
        """Append documents: ``tokens`` ``[sum(lengths)]`` (each document's end-of-text id
        included), ``lengths`` int ``[documents]``, each >= 1."""
        tokens = np.asarray(tokens).astype(self.dtype, copy=False)
        ends = np.cumsum(np.asarray(lengths, dtype=np.int64))
        if len(ends) and ends[-1] != len(tokens):
            raise ValueError(f"the lengths add up to {int(ends[-1])}, but there are {len(tokens)} tokens")
        done, base = 0, 0  # documents and tokens of this call written so far
        while done < len(ends):
            if self._fh is None:
                self._open()
            # the first document that ends at or past the shard's capacity closes the shard
            last = int(np.searchsorted(ends, base + self.shard_tokens - self._n, side="left"))
            last = min(last, len(ends) - 1)
            stop = int(ends[last])
            starts = np.concatenate([[base], ends[done:last]]) - base + self._n
            self._starts.extend(starts.tolist())
            tokens[base:stop].tofile(self._fh)
            self._n += stop - base
            self.tokens += stop - base
            done, base = last + 1, stop
            if self._n >= self.shard_tokens:
                self._close_shard()

    def _name(self, suffix: str) -> str:
        return f"{self.split}-{len(self.shards):05d}{suffix}"

    def _open(self) -> None:
        self._fh = open(self.folder / self._name(".bin"), "wb")
        self._n, self._starts = 0, array.array("q")

    def _close_shard(self) -> None:
        self._fh.close()
        self._fh = None
        starts = np.frombuffer(self._starts, dtype=np.int64)
        np.save(self.folder / self._name(".docs.npy"), np.append(starts, self._n))
        offset = self.tokens - self._n
        self.shards.append({"file": self._name(".bin"), "docs": self._name(".docs.npy"), "offset": offset,
                            "tokens": self._n, "documents": len(starts)})

    def close(self) -> list[dict]:
        """Close the open shard; returns every shard's index entry."""
        if self._fh is not None:
            self._close_shard()
        return self.shards


# --- reading -----------------------------------------------------------------------------------


class ShardedTokens:
    """One split of a prepared corpus as a read-only 1-D token array: ``len`` and slices.

    ``tokens[a:b]`` (step 1) returns a new ``[b - a]`` array of the corpus's dtype, read from
    the shard files with ``os.pread`` (so reads from several threads need no lock). Holds one
    open file and two integers per shard, whatever their size.
    """

    def __init__(self, paths: list[Path], sizes: list[int], dtype: np.dtype, start: int = 0, stop: Optional[int] = None):
        self.dtype = np.dtype(dtype)
        self.paths = [Path(p) for p in paths]
        self._ends = np.cumsum([0, *sizes]).astype(np.int64)  # shard i holds stream tokens [ends[i], ends[i+1])
        self.start = start
        self.stop = int(self._ends[-1]) if stop is None else stop
        if not 0 <= self.start <= self.stop <= self._ends[-1]:
            raise ValueError(f"token range [{start}, {stop}) outside the shards' {int(self._ends[-1])} tokens")
        self._fds: list[int] = []
        for path, size in zip(self.paths, sizes):
            fd = os.open(path, os.O_RDONLY)
            self._fds.append(fd)
            if os.fstat(fd).st_size != size * self.dtype.itemsize:
                raise ValueError(f"{path} holds {os.fstat(fd).st_size} bytes, the index says {size} tokens of "
                                 f"{self.dtype.itemsize} bytes: the corpus is damaged; prepare it again")

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, key: slice) -> np.ndarray:
        if not isinstance(key, slice) or key.step not in (None, 1):
            raise TypeError("ShardedTokens supports slices with step 1 only")
        a, b, _ = key.indices(len(self))
        return self.read(a, max(a, b))

    def read(self, a: int, b: int) -> np.ndarray:
        """Tokens ``a .. b - 1`` of the split, ``[b - a]``."""
        out = np.empty(b - a, dtype=self.dtype)
        size = self.dtype.itemsize
        pos, a, b = 0, a + self.start, b + self.start
        while a < b:
            shard = int(np.searchsorted(self._ends, a, side="right")) - 1
            # to the shard's end, and at most 1 GiB per call (Linux reads at most 2 GiB at once)
            end = min(b, int(self._ends[shard + 1]), a + (1 << 30) // size)
            data = os.pread(self._fds[shard], (end - a) * size, (a - int(self._ends[shard])) * size)
            if len(data) != (end - a) * size:
                raise OSError(f"{self.paths[shard]}: short read (was the corpus changed while training?)")
            out[pos : pos + end - a] = np.frombuffer(data, dtype=self.dtype)
            pos, a = pos + end - a, end
        return out

    def gather(self, starts: np.ndarray, length: int) -> np.ndarray:
        """Rows ``tokens[s : s + length]`` for each ``s`` in ``starts``: ``[len(starts), length]``.

        One ``preadv`` per row, straight into the output (the batch path of
        :class:`twell.recipe.data.PackedSequences`); a row across two shards is read piecewise.
        """
        starts = np.asarray(starts, dtype=np.int64)
        if starts.size and (int(starts.min()) < 0 or int(starts.max()) + length > len(self)):
            raise IndexError(f"rows of {length} tokens from {int(starts.min())} .. {int(starts.max())} overrun "
                             f"the split's {len(self)} tokens")
        out = np.empty((len(starts), length), dtype=self.dtype)
        first = starts + self.start
        shards = np.searchsorted(self._ends, first, side="right") - 1
        inside = first + length <= self._ends[shards + 1]
        nbytes, size = length * self.dtype.itemsize, self.dtype.itemsize
        for row, (a, shard, whole) in enumerate(zip(first.tolist(), shards.tolist(), inside.tolist())):
            if whole and hasattr(os, "preadv"):
                got = os.preadv(self._fds[shard], [out[row].data], (a - int(self._ends[shard])) * size)
                if got != nbytes:
                    raise OSError(f"{self.paths[shard]}: short read (was the corpus changed while training?)")
            else:
                out[row] = self.read(a - self.start, a - self.start + length)
        return out

    def close(self) -> None:
        for fd in self._fds:
            os.close(fd)
        self._fds = []

    def __del__(self):
        for fd in getattr(self, "_fds", []):
            try:
                os.close(fd)
            except OSError:
                pass


class PreparedCorpus:
    """A folder written by :func:`prepare_corpus`: its index, splits and tokenizer."""

    def __init__(self, folder):
        self.folder = Path(folder)
        path = self.folder / INDEX_NAME
        try:
            self.index = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise ValueError(f"{path}: not a readable twell corpus index ({err})") from err
        if self.index.get("format") != FORMAT or self.index.get("version") != VERSION:
            raise ValueError(f"{path}: format {self.index.get('format')!r} version {self.index.get('version')!r}, "
                             f"this twell reads {FORMAT!r} version {VERSION}")
        self.dtype = np.dtype(self.index["dtype"]).newbyteorder("<")

    def tokens(self, split: str) -> ShardedTokens:
        """The split's tokens (``split``: ``"train"`` or ``"validation"``)."""
        s = self.index["splits"][split]
        return ShardedTokens([self.folder / sh["file"] for sh in s["shards"]], [sh["tokens"] for sh in s["shards"]],
                             self.dtype, s["start"], s["stop"])

    def windows(self, split: str, seq_len: int, seed: int = 0) -> PackedSequences:
        """The split's packed windows, in Feistel order (memory independent of the corpus)."""
        try:
            return PackedSequences(self.tokens(split), seq_len, seed, order="feistel")
        except ValueError as err:
            raise ValueError(f"{self.folder} ({split}): {err}") from err

    def tokenizer(self, spec: Optional[str] = None):
        """The tokenizer saved in the folder. ``spec`` (a run's ``--tokenizer``) must be ``None``,
        ``"bytes"`` (the run's default, so it stands for "not given") or the one it was prepared with."""
        saved = self.index["tokenizer"]
        if spec not in (None, "bytes", saved["spec"]):
            raise ValueError(f"--data {self.folder} was prepared with tokenizer {saved['spec']!r}, not {spec!r}: "
                             "leave --tokenizer out (a prepared corpus brings its own) or prepare it again")
        tok = load_tokenizer(str(self.folder))
        if tok.vocab_size != saved["vocab_size"] or tok.eos_id != saved["eos_id"]:
            raise ValueError(f"{self.folder}: the saved tokenizer has {tok.vocab_size} ids (end of text {tok.eos_id}), "
                             f"the index says {saved['vocab_size']} ({saved['eos_id']})")
        return tok


def prepared_corpus(specs: Iterable[str]) -> Optional[PreparedCorpus]:
    """The prepared corpus among ``--data`` specs (which must then be that folder alone), or None."""
    specs = list(specs)
    hits = [s for s in specs if (Path(s) / INDEX_NAME).is_file()]
    if not hits:
        return None
    if len(specs) > 1:
        raise ValueError(f"--data {hits[0]} is a prepared corpus and must be given alone "
                         "(twell data prepare takes several sources into one folder)")
    return PreparedCorpus(hits[0])


# --- preparing ---------------------------------------------------------------------------------

_worker_tokenizer = None
_worker_val_fraction = 0.0


def _init_worker(tokenizer_spec: str, val_fraction: float) -> None:
    global _worker_tokenizer, _worker_val_fraction
    _worker_tokenizer, _worker_val_fraction = load_tokenizer(tokenizer_spec), val_fraction


def _init_pool_worker(tokenizer_spec: str, val_fraction: float) -> None:
    # One thread per worker process: the processes are the parallelism (a fast HF tokenizer
    # would otherwise start a thread pool in each).
    os.environ["TOKENIZERS_PARALLELISM"] = "false"
    _init_worker(tokenizer_spec, val_fraction)


def _tokenize(docs: list[tuple[str, str]]) -> tuple[int, dict]:
    """A batch of ``(key, text)`` -> ``(documents, {is_validation: (tokens, lengths)})``, each
    document's tokens followed by the end-of-text id, in the batch's order."""
    tok = _worker_tokenizer
    encoded = tok.encode_batch([text for _, text in docs])
    sides = [is_validation(key, _worker_val_fraction) for key, _ in docs]
    out = {}
    for val in (False, True):
        ids = [e for side, e in zip(sides, encoded) if side == val]
        if not ids:
            continue
        dtype = token_dtype(tok.vocab_size)
        eos = np.array([tok.eos_id], dtype=dtype)
        tokens = np.concatenate([part for e in ids for part in (e.astype(dtype, copy=False), eos)])
        out[val] = (tokens, np.array([len(e) + 1 for e in ids], dtype=np.int64))
    return len(docs), out


def _batches(docs: Iterator[tuple[str, str]], max_docs: int, max_chars: int) -> Iterator[list[tuple[str, str]]]:
    """Consecutive documents in batches of at most ``max_docs`` documents or about ``max_chars`` characters."""
    batch, chars = [], 0
    for key, text in docs:
        batch.append((key, text))
        chars += len(text)
        if len(batch) >= max_docs or chars >= max_chars:
            yield batch
            batch, chars = [], 0
    if batch:
        yield batch


def _map_in_order(items: Iterator, workers: int, initargs: tuple) -> Iterator:
    """``_tokenize`` of each item, in order, over ``workers`` processes (0: in this one), with
    at most ``2 * workers`` batches in flight, so that reading never runs far ahead."""
    if workers == 0:
        _init_worker(*initargs)
        for item in items:
            yield _tokenize(item)
        return
    # fork: the workers start at once (a fresh interpreter would import torch and transformers
    # through the twell package, seconds per worker); they only run numpy and the tokenizer.
    ctx = multiprocessing.get_context("fork" if sys.platform.startswith("linux") else "spawn")
    with ctx.Pool(workers, initializer=_init_pool_worker, initargs=initargs) as pool:
        pending: deque = deque()
        for item in items:
            pending.append(pool.apply_async(_tokenize, (item,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()


def _position_split(shards: list[dict], total: int, val_fraction: float, folder: Path) -> dict:
    """Both splits over the same shards, validation being the last ``val_fraction`` of the
    tokens (the raw path's fallback, :func:`twell.recipe.data.build_streams`)."""
    cut = min(max(int(total * (1.0 - val_fraction)), 1), total - 1)
    starts = [np.load(folder / sh["docs"])[:-1] + sh["offset"] for sh in shards]
    n_train = int(sum(int((s < cut).sum()) for s in starts))  # documents that start before the cut
    n_docs = sum(sh["documents"] for sh in shards)
    return {"train": {"split_by": "position", "documents": n_train, "start": 0, "stop": cut, "shards": shards},
            "validation": {"split_by": "position", "documents": n_docs - n_train, "start": cut, "stop": total,
                           "shards": shards}}


def finish_corpus(out, tokenizer_spec: str, train: ShardWriter, validation: ShardWriter, val_fraction: float,
                  tokenizer=None, **meta) -> dict:
    """Close the two splits' writers, save the tokenizer and write the index (last, through a
    temporary name, so that a folder with an index is a complete corpus); returns the index.
    ``meta`` (documents, sources, ...) goes into the index as given. Used by
    :func:`prepare_corpus`; a test can write tokens with :class:`ShardWriter` directly.
    ``tokenizer``: the loaded ``tokenizer_spec``, if at hand."""
    out = Path(out)
    tok = tokenizer or load_tokenizer(tokenizer_spec)
    shards = {"train": train.close(), "validation": validation.close()}
    total = train.tokens + validation.tokens
    if total < 2:
        raise ValueError(f"{out}: {total} token(s) in all, too few to split into training and validation")
    if shards["train"] and shards["validation"]:
        splits = {name: {"split_by": "key", "documents": sum(sh["documents"] for sh in shards[name]), "start": 0,
                         "stop": w.tokens, "shards": shards[name]}
                  for name, w in (("train", train), ("validation", validation))}
    else:
        splits = _position_split(shards["train"] or shards["validation"], total, val_fraction, out)
    tok.save(out)
    index = {"format": FORMAT, "version": VERSION, "dtype": train.dtype.name,
             "tokenizer": {"spec": tokenizer_spec, "name": tok.name, "vocab_size": tok.vocab_size, "eos_id": tok.eos_id},
             **meta, "val_fraction": val_fraction, "tokens": total, "splits": splits}
    tmp = out / (INDEX_NAME + ".tmp")
    tmp.write_text(json.dumps(index, indent=1))
    tmp.replace(out / INDEX_NAME)
    return index


def prepare_corpus(sources: list[str], tokenizer: str, out, val_fraction: float = 0.02, text_field: str = "text",
                   max_docs: Optional[int] = None, workers: Optional[int] = None, shard_tokens: int = 1 << 28,
                   batch_docs: int = 256, batch_chars: int = 4 << 20, progress: bool = True) -> dict:
    """Tokenize ``sources`` (``--data`` specs: files, folders, globs, ``stdlib``, ``hf:NAME``)
    once into a prepared folder ``out`` (see the module docstring); returns its index.

    Documents are read in this process, in the order of :func:`iter_documents`, and tokenized
    in batches (``batch_docs`` documents or ``batch_chars`` characters, one ``encode_batch``
    call each) by ``workers`` processes (0: in this one; default: 0 for byte tokens, else the
    CPU count, at most 8).
    Results are written in document order, so the folder does not depend on ``workers``.
    Memory: a few batches in flight and one open shard's document starts, whatever the
    corpus size. ``out`` must not exist or be empty; on failure it is left empty.
    """
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if workers is not None and workers < 0:
        raise ValueError(f"workers must be >= 0, got {workers}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"--out {out} exists and is not an empty folder; give a new one")
    tokenizer = tokenizer or "bytes"
    tok = load_tokenizer(tokenizer)
    if workers is None:
        # Byte tokens are one memory copy: sending the text to another process would cost more
        # (measured here: 46M tokens/s in this process, 9M with 2 workers).
        workers = 0 if isinstance(tok, ByteTokenizer) else min(8, os.cpu_count() or 1)
    dtype = token_dtype(tok.vocab_size)
    out.mkdir(parents=True, exist_ok=True)
    try:
        return _prepare(sources, tokenizer, tok, dtype, out, val_fraction, text_field, max_docs, workers,
                        shard_tokens, batch_docs, batch_chars, progress)
    except BaseException:
        for path in out.iterdir():  # it was empty: leave it so, for the next attempt
            shutil.rmtree(path) if path.is_dir() else path.unlink()
        raise


def _prepare(sources, tokenizer_spec, tok, dtype, out, val_fraction, text_field, max_docs, workers, shard_tokens,
             batch_docs, batch_chars, progress) -> dict:
    from tqdm.auto import tqdm

    writers = {val: ShardWriter(out, split, dtype, shard_tokens) for val, split in ((False, "train"), (True, "validation"))}
    t0 = time.perf_counter()
    batches = _batches(iter_documents(sources, text_field, max_docs), batch_docs, batch_chars)
    results = _map_in_order(batches, workers, (tokenizer_spec, val_fraction))
    n_docs = 0
    # The bar is made after the worker pool (the first next(results)): it starts a monitor
    # thread, and forking a process with threads invites deadlocks.
    bar = None
    for docs, parts in results:
        if bar is None:
            bar = tqdm(desc="prepare", unit="doc", unit_scale=True, disable=not progress, dynamic_ncols=True,
                       mininterval=1.0)
        for val, (tokens, lengths) in parts.items():
            writers[val].add(tokens, lengths)
        n_docs += docs
        bar.update(docs)
        bar.set_postfix_str(f"{writers[False].tokens + writers[True].tokens:,} tokens", refresh=False)
    if bar is not None:
        bar.close()
    if n_docs == 0:
        raise ValueError(f"--data {sources}: found no documents")
    index = finish_corpus(out, tokenizer_spec, writers[False], writers[True], val_fraction, tok, documents=n_docs,
                          sources=list(sources), text_field=text_field, max_docs=max_docs)
    index["seconds"] = time.perf_counter() - t0  # for the caller's report; not saved (the folder is deterministic)
    return index
