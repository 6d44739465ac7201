"""Data for twell train: tokenizers, document splits, packed sequences."""

import json

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from twell.recipe.data import (ByteTokenizer, PackedSequences, build_streams, is_validation, iter_documents,
                              load_tokenizer, stdlib_documents)


@settings(max_examples=200, deadline=None)
@given(st.text())
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert ids.dtype == np.uint16 and (len(ids) == 0 or int(ids.max()) < 256)
    assert tok.decode(ids) == text


def test_load_tokenizer_default_and_saved(tmp_path):
    assert isinstance(load_tokenizer(None), ByteTokenizer)
    ByteTokenizer().save(tmp_path)
    assert isinstance(load_tokenizer(str(tmp_path)), ByteTokenizer)


def test_stdlib_split_by_file_is_deterministic_and_disjoint():
    keys = [k for k, _ in stdlib_documents()]
    assert len(keys) > 100 and keys == sorted(keys)
    val = {k for k in keys if is_validation(k, 0.05)}
    again = {k for k in keys if is_validation(k, 0.05)}
    assert val == again and 0 < len(val) < 0.15 * len(keys)
    # a larger fraction only moves files into validation, never out of it
    assert val <= {k for k in keys if is_validation(k, 0.2)}


def _corpus(tmp_path):
    (tmp_path / "a.txt").write_text("hello world\n" * 50)
    (tmp_path / "b.md").write_text("# title\nsome text " * 40)
    with open(tmp_path / "c.jsonl", "w") as fh:
        for i in range(200):
            fh.write(json.dumps({"text": f"document {i} " * 5, "other": i}) + "\n")
    return tmp_path


def test_build_streams_local_files(tmp_path):
    _corpus(tmp_path)
    tok = ByteTokenizer()
    train, val = build_streams([str(tmp_path)], tok, val_fraction=0.1)
    docs = list(iter_documents([str(tmp_path)]))
    assert len(docs) == 202
    n_bytes = sum(len(t.encode()) for _, t in docs)
    assert len(train) + len(val) == n_bytes + len(docs)  # one eos per document
    assert (train == tok.eos_id).sum() + (val == tok.eos_id).sum() == len(docs)
    # validation documents are exactly those whose key hashes under the fraction
    n_val = sum(is_validation(k, 0.1) for k, _ in docs)
    assert 0 < n_val < 60 and (val == tok.eos_id).sum() == n_val
    train2, val2 = build_streams([str(tmp_path)], tok, val_fraction=0.1)
    assert np.array_equal(train, train2) and np.array_equal(val, val2)


def test_single_file_falls_back_to_tail_split(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 1000)
    train, val = build_streams([str(tmp_path / "one.txt")], ByteTokenizer(), val_fraction=0.1)
    assert len(val) > 0 and len(train) + len(val) == 1001


def test_jsonl_missing_field_is_a_clear_error(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x"}) + "\n")
    with pytest.raises(ValueError, match="expected a field 'text', the row has \\['body'\\]; see --text-field"):
        build_streams([str(tmp_path / "d.jsonl")], ByteTokenizer())


def test_missing_path_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="no such file"):
        build_streams([str(tmp_path / "nope*.txt")], ByteTokenizer())


def test_parquet(tmp_path):
    pa = pytest.importorskip("pyarrow")
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [f"row {i} " * 10 for i in range(100)]}), tmp_path / "t.parquet")
    train, val = build_streams([str(tmp_path / "t.parquet")], ByteTokenizer(), val_fraction=0.2)
    assert (train == 256).sum() + (val == 256).sum() == 100


def test_packed_sequences_deterministic_and_cover_each_epoch():
    tokens = np.arange(1001, dtype=np.uint16)
    data = PackedSequences(tokens, seq_len=10, seed=3)
    assert len(data) == 100
    epoch0 = data.batch(0, 100)
    assert epoch0.shape == (100, 11) and epoch0.dtype == torch.int64
    # each window is 11 consecutive tokens starting at a multiple of 10; an epoch visits all of them once
    assert torch.equal(epoch0[:, 1:] - epoch0[:, :-1], torch.ones(100, 10, dtype=torch.int64))
    assert sorted((epoch0[:, 0] // 10).tolist()) == list(range(100))
    # sample k depends only on (seed, k), not on how the samples are fetched
    again = PackedSequences(tokens, seq_len=10, seed=3)
    assert torch.equal(again.batch(37, 5), epoch0[37:42])
    assert torch.equal(torch.cat([again.batch(95, 10)[:5]]), epoch0[95:])
    assert not torch.equal(PackedSequences(tokens, 10, seed=4).batch(0, 100), epoch0)
    assert not torch.equal(data.batch(100, 100), epoch0)  # a new order for the next epoch


def test_packed_sequences_too_short():
    with pytest.raises(ValueError, match="fewer than one sequence"):
        PackedSequences(np.arange(5, dtype=np.uint16), seq_len=10)


def _local_hf_tokenizer(path):
    """A small byte-level BPE tokenizer trained here and saved with save_pretrained (no download)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["def f(x):\n    return x + 1\n"] * 20, trainer)
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|endoftext|>").save_pretrained(path)
    return str(path)


def test_hf_tokenizer_by_path_round_trip_and_streams(tmp_path):
    spec = _local_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(spec)
    text = "héllo wörld 🙂\ndef g(y):\n    return y"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == 0 and tok.vocab_size > 256
    (tmp_path / "d").mkdir()
    for i in range(20):
        (tmp_path / "d" / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n")
    train, val = build_streams([str(tmp_path / "d")], tok, val_fraction=0.2)
    assert (train == 0).sum() + (val == 0).sum() == 20
    tok.save(tmp_path / "saved")  # what a checkpoint holds
    assert load_tokenizer(str(tmp_path / "saved")).encode(text).tolist() == tok.encode(text).tolist()


def test_split_does_not_depend_on_how_the_path_is_written(tmp_path, monkeypatch):
    """Keys are paths relative to the --data root given: relative, absolute, a glob or a moved
    copy of the corpus all give the same split."""
    import shutil

    (tmp_path / "corpus").mkdir()
    corpus = _corpus(tmp_path / "corpus")
    monkeypatch.chdir(tmp_path)
    tok = ByteTokenizer()
    keys = [k for k, _ in iter_documents(["corpus"])]
    assert keys[:3] == ["a.txt", "b.md", "c.jsonl:0"]
    assert keys == [k for k, _ in iter_documents([str(corpus.resolve())])]
    want = build_streams(["corpus"], tok, val_fraction=0.1)
    assert 0 < len(want[1]) < len(want[0])
    shutil.copytree(corpus, tmp_path / "elsewhere" / "copy")
    for spec in ([str(corpus.resolve())], ["./corpus/"], ["corpus/*"], [str(corpus.resolve() / "*")],
                 ["elsewhere/copy"], [str(tmp_path / "elsewhere" / "copy")]):
        got = build_streams(spec, tok, val_fraction=0.1)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), spec
    # one file, given relative or absolute: keyed on its name
    assert [k for k, _ in iter_documents(["corpus/a.txt"])] == [k for k, _ in iter_documents([str(corpus.resolve() / "a.txt")])] == ["a.txt"]


@pytest.mark.parametrize("side", [True, False])
def test_split_falls_back_when_either_side_is_empty(tmp_path, monkeypatch, side):
    """Every document in validation (or every one in training): split by position instead, and
    both sides are non-empty."""
    import twell.recipe.data as data

    _corpus(tmp_path)
    monkeypatch.setattr(data, "is_validation", lambda key, fraction: side)
    train, val = build_streams([str(tmp_path)], ByteTokenizer(), val_fraction=0.1)
    assert len(train) > 0 and len(val) > 0
    n = len(train) + len(val)
    assert len(val) == n - int(n * 0.9)
