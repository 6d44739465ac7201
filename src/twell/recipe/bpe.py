"""Subword tokenizers learnt from a corpus: ``twell data tokenizer``.

:func:`train_bpe` trains a byte-level BPE with the ``tokenizers`` library (GPT-2's byte-level
pre-tokenizer, so every text encodes and decodes losslessly; the 256 bytes, then merges learnt
from the corpus) on the training split of ``--data`` sources, offline, and saves it as a Hugging
Face fast tokenizer folder (``tokenizer.json``, ``tokenizer_config.json``) with one special
token, ``<|endoftext|>``, the end-of-text id that separates documents. ``twell train --tokenizer
FOLDER``, ``twell data prepare --tokenizer FOLDER`` and ``AutoTokenizer.from_pretrained(FOLDER)``
load it.

Only training documents are read (the split is the runs': :func:`twell.recipe.data.is_validation`
of each document's key, with the same ``val_fraction``), so validation text stays unseen. At
most ``max_chars`` characters of them are used: the documents in the order of a keyed hash of
their keys (not the split's hash), up to the first that would not fit. The sample, and so the
tokenizer, depends only on the documents' keys and texts: not on the order of the sources, the
number of threads or the machine. Training takes seconds for tens of megabytes of text.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import time
from pathlib import Path
from typing import Iterable, Optional

from .data import is_validation, iter_documents

__all__ = ["EOS_TOKEN", "INFO_NAME", "training_sample", "train_bpe"]

EOS_TOKEN = "<|endoftext|>"
INFO_NAME = "twell_bpe.json"  # how the tokenizer was trained, beside its files
MIN_VOCAB = 258  # the 256 bytes, the end-of-text token and at least one merge


def _rank(key: str) -> int:
    """The order in which documents enter the sample: a keyed hash of their key."""
    return int.from_bytes(hashlib.blake2b(key.encode("utf-8"), digest_size=8, person=b"twell-bpe").digest(), "big")


def training_sample(sources: Iterable[str], max_chars: Optional[int], val_fraction: float = 0.02,
                    text_field: str = "text", max_docs: Optional[int] = None) -> list[tuple[str, str]]:
    """``(key, text)`` of the training documents of ``sources`` that a tokenizer learns from,
    sorted by key: all of them, or with ``max_chars`` those before the first document, in the
    order of :func:`_rank`, that would bring their characters over ``max_chars``. Memory: the
    sample, built in one pass (whatever the order in which the documents come)."""
    kept: list[tuple[int, str, str]] = []  # a max-heap on the rank: (-rank, key, text)
    chars, cutoff = 0, None  # cutoff: the lowest rank left out so far; nothing at or above it enters
    for key, text in iter_documents(list(sources), text_field, max_docs):
        if is_validation(key, val_fraction):
            continue
        if max_chars is None:
            kept.append((0, key, text))
            continue
        rank = _rank(key)
        if cutoff is not None and rank >= cutoff:
            continue
        heapq.heappush(kept, (-rank, key, text))
        chars += len(text)
        while chars > max_chars:  # the highest ranks leave first: what stays is a prefix of the order
            negative, _, dropped = heapq.heappop(kept)
            chars -= len(dropped)
            cutoff = -negative
    return sorted((key, text) for _, key, text in kept)


def train_bpe(sources: list[str], out, vocab_size: int = 16384, max_chars: Optional[int] = 32_000_000,
              val_fraction: float = 0.02, text_field: str = "text", max_docs: Optional[int] = None,
              min_frequency: int = 2) -> dict:
    """Train a byte-level BPE of ``vocab_size`` ids on the training documents of ``sources``
    (:func:`training_sample`) and save it as a Hugging Face fast tokenizer in ``out`` (absent or
    empty), with :data:`INFO_NAME`. Returns that file's contents: the sources, the sample's
    documents and characters, ``vocab_size``, ``eos_id``, ``seconds`` and ``sha256`` (of the
    tokenizer's JSON: equal for equal tokenizers).

    Raises ValueError for a vocabulary under :data:`MIN_VOCAB` or a corpus without training
    documents, FileExistsError for an ``out`` that holds files, before any work."""
    if vocab_size < MIN_VOCAB:
        raise ValueError(f"vocab_size must be >= {MIN_VOCAB} (256 bytes, {EOS_TOKEN} and a merge), got {vocab_size}")
    if max_chars is not None and max_chars < 1:
        raise ValueError(f"max_chars must be >= 1 (or None: every training document), got {max_chars}")
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    if min_frequency < 1:
        raise ValueError(f"min_frequency must be >= 1, got {min_frequency}")
    out = Path(out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise FileExistsError(f"{out} exists and is not an empty folder; give a new one")
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    t0 = time.perf_counter()
    docs = training_sample(sources, max_chars, val_fraction, text_field, max_docs)
    if not docs:
        raise ValueError(f"{' '.join(sources)}: no training document to learn a tokenizer from (the split keeps "
                         f"{val_fraction:g} of the documents for validation)")
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, special_tokens=[EOS_TOKEN],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator((text for _, text in docs), trainer, length=len(docs))
    info = {"type": "byte-level BPE", "sources": list(sources), "val_fraction": val_fraction, "text_field": text_field,
            "max_docs": max_docs, "max_chars": max_chars, "documents": len(docs),
            "chars": sum(len(text) for _, text in docs), "vocab_size": tok.get_vocab_size(),
            "eos_token": EOS_TOKEN, "eos_id": tok.token_to_id(EOS_TOKEN), "min_frequency": min_frequency,
            "sha256": hashlib.sha256(tok.to_str().encode("utf-8")).hexdigest(),
            "seconds": time.perf_counter() - t0}
    out.mkdir(parents=True, exist_ok=True)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=EOS_TOKEN).save_pretrained(out)
    (out / INFO_NAME).write_text(json.dumps(info, indent=1))
    return info
