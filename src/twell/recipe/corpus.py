"""What a run reads: a prepared folder's shards (``twell data prepare``) or raw corpora tokenized
when the run starts, and the tokenizer that goes with them."""

from __future__ import annotations

from typing import Optional

import numpy as np

from .data import PackedSequences, build_streams, load_tokenizer
from .shards import prepared_corpus


def corpus_tokenizer(specs: list[str], spec: Optional[str]):
    """The tokenizer of a run on ``specs``: a prepared folder's own (saved in it when it was
    prepared; ``spec`` must then be ``None``, ``"bytes"`` (the default) or the same name), else
    :func:`load_tokenizer` of ``spec``."""
    corpus = prepared_corpus(specs)
    return load_tokenizer(spec) if corpus is None else corpus.tokenizer(spec)


def load_corpus(specs: list[str], tokenizer, seq_len: int, seed: int = 0, val_fraction: float = 0.02,
                text_field: str = "text", max_docs: Optional[int] = None,
                streams: Optional[tuple[np.ndarray, np.ndarray]] = None) -> tuple[PackedSequences, PackedSequences]:
    """``(training, validation)`` samples of a run.

    A prepared folder (``twell data prepare``): its shards, read from disk window by window, in
    Feistel order; its split is the one made when it was prepared (``val_fraction``,
    ``text_field``, ``max_docs`` and ``tokenizer`` do not apply). Otherwise the raw corpora are
    tokenized now (:func:`build_streams`), or ``streams`` (``(train, validation)`` token arrays)
    are used as given, in ``randperm`` order.
    """
    corpus = None if streams is not None else prepared_corpus(specs)
    if corpus is not None:
        return corpus.windows("train", seq_len, seed), corpus.windows("validation", seq_len, seed)
    train, val = streams if streams is not None else build_streams(specs, tokenizer, val_fraction, text_field, max_docs)
    return PackedSequences(train, seq_len, seed), PackedSequences(val, seq_len, seed)
