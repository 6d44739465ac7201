"""Prepared corpora (twell data prepare) and the streaming loader: the same split and tokens as
the raw path, ranks' shares, exact resume, memory bounded on a 2 GB corpus."""

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest
import torch

from test_train_data import _corpus, _local_hf_tokenizer
from test_train_loss import config, small_corpus
from twell.cli import main
from twell.recipe.corpus import corpus_tokenizer, load_corpus
from twell.recipe.data import (ByteTokenizer, PackedSequences, Prefetcher, build_streams, feistel_permute,
                              load_tokenizer, next_first)
from twell.recipe.report import read_history
from twell.recipe.shards import (INDEX_NAME, PreparedCorpus, ShardedTokens, ShardWriter, finish_corpus,
                                prepare_corpus, prepared_corpus)


def _prepare(src, out, **kw):
    return prepare_corpus([str(src)], kw.pop("tokenizer", "bytes"), out, progress=False, **kw)


def _synthetic(out, n_tokens, shard_tokens=1000, doc_len=50, val_every=0):
    """A prepared folder written token by token: training token i is ``i % 60000``, so a
    window's first token tells where it starts (for corpora under 60000 tokens)."""
    out.mkdir()
    train = ShardWriter(out, "train", np.dtype("<u2"), shard_tokens)
    val = ShardWriter(out, "validation", np.dtype("<u2"), shard_tokens)
    tokens = (np.arange(n_tokens) % 60000).astype(np.uint16)
    lengths = [doc_len] * (n_tokens // doc_len) + [n_tokens % doc_len] * (n_tokens % doc_len > 0)
    train.add(tokens, lengths)
    val.add(np.arange(200, dtype=np.uint16), [100, 100])
    finish_corpus(out, "bytes", train, val, 0.02)
    return PreparedCorpus(out)


# --- preparing -----------------------------------------------------------------------------


def test_prepared_corpus_has_the_raw_paths_split_and_tokens(tmp_path):
    (tmp_path / "src").mkdir()
    src = _corpus(tmp_path / "src")
    index = _prepare(src, tmp_path / "a", val_fraction=0.1, shard_tokens=3000)
    train, val = build_streams([str(src)], ByteTokenizer(), val_fraction=0.1)
    corpus = PreparedCorpus(tmp_path / "a")
    assert np.array_equal(corpus.tokens("train")[:], train) and np.array_equal(corpus.tokens("validation")[:], val)
    assert index["dtype"] == "uint16" and index["tokenizer"]["vocab_size"] == 257 and index["documents"] == 202
    tr = index["splits"]["train"]
    assert tr["split_by"] == "key" and len(tr["shards"]) > 1  # shards of about 3000 tokens
    assert tr["documents"] + index["splits"]["validation"]["documents"] == 202
    # shards hold whole documents; docs.npy marks where each starts (after the previous eos)
    for sh in tr["shards"]:
        tokens = np.fromfile(tmp_path / "a" / sh["file"], dtype="<u2")
        starts = np.load(tmp_path / "a" / sh["docs"])
        assert len(tokens) == sh["tokens"] == starts[-1] and len(starts) == sh["documents"] + 1
        assert starts[0] == 0 and (tokens[starts[1:] - 1] == 256).all() and (tokens == 256).sum() == sh["documents"]
        assert np.array_equal(tokens, train[sh["offset"] : sh["offset"] + sh["tokens"]])
    assert isinstance(load_tokenizer(str(tmp_path / "a")), ByteTokenizer)
    # the folder does not depend on the number of worker processes
    _prepare(src, tmp_path / "b", val_fraction=0.1, shard_tokens=3000, workers=2)
    for path in (tmp_path / "a").iterdir():
        assert path.read_bytes() == (tmp_path / "b" / path.name).read_bytes(), path.name


def test_one_document_splits_by_position_like_the_raw_path(tmp_path):
    (tmp_path / "one.txt").write_text("x" * 1000)
    index = _prepare(tmp_path / "one.txt", tmp_path / "p", val_fraction=0.1)
    train, val = build_streams([str(tmp_path / "one.txt")], ByteTokenizer(), val_fraction=0.1)
    corpus = PreparedCorpus(tmp_path / "p")
    assert np.array_equal(corpus.tokens("train")[:], train) and np.array_equal(corpus.tokens("validation")[:], val)
    assert index["splits"]["validation"]["split_by"] == "position"


def test_hf_tokenizer_batches_and_brings_itself(tmp_path):
    spec = _local_hf_tokenizer(tmp_path / "tok")
    tok = load_tokenizer(spec)
    texts = ["def f(x):\n    return x", "", "héllo 🙂", "return x + 1\n" * 50]
    assert [e.tolist() for e in tok.encode_batch(texts)] == [tok.encode(t).tolist() for t in texts]
    (tmp_path / "d").mkdir()
    for i in range(40):
        (tmp_path / "d" / f"{i}.txt").write_text(f"def f{i}(x):\n    return x + {i}\n" * (i + 1))
    _prepare(tmp_path / "d", tmp_path / "p", tokenizer=spec, val_fraction=0.2, workers=2)
    train, val = build_streams([str(tmp_path / "d")], tok, val_fraction=0.2)
    corpus = PreparedCorpus(tmp_path / "p")
    assert np.array_equal(corpus.tokens("train")[:], train) and np.array_equal(corpus.tokens("validation")[:], val)
    # a run on the folder gets the tokenizer it was prepared with, with or without --tokenizer
    for given in (None, "bytes", spec):
        got = corpus_tokenizer([str(tmp_path / "p")], given)
        assert got.vocab_size == tok.vocab_size and got.encode(texts[0]).tolist() == tok.encode(texts[0]).tolist()
    with pytest.raises(ValueError, match="was prepared with tokenizer .*, not 'gpt2': leave --tokenizer out"):
        corpus_tokenizer([str(tmp_path / "p")], "gpt2")


def test_prepare_errors(tmp_path):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.txt").write_text("hello " * 100)
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("")
    with pytest.raises(FileExistsError, match="is not an empty folder"):
        _prepare(tmp_path / "src", tmp_path / "full")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="found no documents"):
        _prepare(tmp_path / "empty", tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []  # left empty for the next attempt
    _prepare(tmp_path / "src", tmp_path / "out")
    with pytest.raises(ValueError, match="is a prepared corpus and must be given alone"):
        prepared_corpus([str(tmp_path / "out"), str(tmp_path / "src")])
    assert prepared_corpus([str(tmp_path / "src")]) is None
    with open(tmp_path / "out" / "train-00000.bin", "ab") as fh:
        fh.write(b"\0\0")
    with pytest.raises(ValueError, match="the corpus is damaged"):
        PreparedCorpus(tmp_path / "out").tokens("train")
    with pytest.raises(SystemExit, match="^twell data prepare: --out .* is not an empty folder"):
        main(["data", "prepare", str(tmp_path / "src"), "--out", str(tmp_path / "out")])


# --- reading -------------------------------------------------------------------------------


def test_sharded_tokens_read_like_one_array(tmp_path):
    corpus = _synthetic(tmp_path / "c", 10_000, shard_tokens=700)
    want = (np.arange(10_000) % 60000).astype(np.uint16)
    tokens = corpus.tokens("train")
    assert len(tokens) == 10_000 and len(corpus.index["splits"]["train"]["shards"]) == 15
    rng = np.random.default_rng(0)
    for a, b in rng.integers(0, 10_001, size=(200, 2)):
        a, b = min(a, b), max(a, b)
        assert np.array_equal(tokens[a:b], want[a:b]), (a, b)
    starts = rng.integers(0, 10_000 - 33, size=100)  # rows across shard ends included
    assert np.array_equal(tokens.gather(starts, 33), want[starts[:, None] + np.arange(33)])
    with pytest.raises(IndexError):
        tokens.gather([10_000 - 10], 33)
    part = ShardedTokens(tokens.paths, [sh["tokens"] for sh in corpus.index["splits"]["train"]["shards"]],
                         tokens.dtype, start=650, stop=1500)
    assert np.array_equal(part[:], want[650:1500]) and np.array_equal(part[100:200], want[750:850])


@pytest.mark.parametrize("n", [1, 2, 3, 5, 64, 65, 1000, 4097])
def test_feistel_order_is_a_permutation(n):
    perm = feistel_permute(np.arange(n), n, seed=7, epoch=2)
    assert sorted(perm.tolist()) == list(range(n))
    if n >= 64:
        assert not np.array_equal(perm, feistel_permute(np.arange(n), n, seed=8, epoch=2))
        assert not np.array_equal(perm, feistel_permute(np.arange(n), n, seed=7, epoch=3))
        # shuffled, not shifted: neighbours land far apart and the order is uncorrelated
        assert abs(np.corrcoef(np.arange(n), perm)[0, 1]) < 0.2
        assert np.median(np.abs(np.diff(perm))) > n / 10
    # any subset of positions maps like the whole
    some = np.array([0, n - 1, n // 2])
    assert np.array_equal(feistel_permute(some, n, 7, 2), perm[some])


def test_streaming_windows_cover_each_epoch_in_a_seeded_order(tmp_path):
    corpus = _synthetic(tmp_path / "c", 16 * 120 + 1)
    data = corpus.windows("train", 16, seed=3)
    assert len(data) == 120 and data.order == "feistel"
    epoch0 = data.batch(0, 120)
    assert epoch0.shape == (120, 17) and epoch0.dtype == torch.int64
    assert torch.equal(epoch0[:, 1:] - epoch0[:, :-1], torch.ones(120, 16, dtype=torch.int64))
    assert sorted((epoch0[:, 0] // 16).tolist()) == list(range(120))
    assert torch.equal(data.batch(37, 5), epoch0[37:42]) and torch.equal(data.batch(115, 10)[:5], epoch0[115:])
    assert not torch.equal(data.batch(120, 120), epoch0)
    # window ids are computed (and kept) per block of 4096 samples: a batch across two blocks
    # is what the samples one by one are
    assert torch.equal(data.batch(4090, 12), torch.cat([data.batch(k, 1) for k in range(4090, 4102)]))
    assert not torch.equal(corpus.windows("train", 16, seed=4).batch(0, 120), epoch0)
    val = corpus.windows("validation", 16)
    assert torch.equal(val.eval_batch(0, 2)[0], torch.arange(17))


def _rank_batches(data, B, A, rank, world, steps, start_step=0):
    """What a trainer rank asks for over ``steps`` steps, through its prefetcher."""
    loader = Prefetcher(data, B, A, rank, world)
    out = []
    for step in range(start_step, start_step + steps):
        for micro in range(A):
            out.append(loader.batch(step * B * A * world + (micro * world + rank) * B))
    loader.close()
    return out


@pytest.mark.parametrize("world, B, A", [(3, 2, 2), (2, 5, 1), (4, 1, 3)])
def test_rank_shares_are_disjoint_and_complete(tmp_path, world, B, A):
    """Ranks given explicitly (no process group): over an epoch every window is read by exactly
    one rank, and each step's windows are those that one process with all the batch reads."""
    n = B * A * world * 10  # windows: 10 steps make one epoch
    data = _synthetic(tmp_path / "c", 8 * n + 1).windows("train", 8, seed=1)
    assert len(data) == n
    per_rank = [_rank_batches(data, B, A, r, world, 10) for r in range(world)]
    starts = [int(t) // 8 for r in per_rank for b in r for t in b[:, 0]]
    assert sorted(starts) == list(range(n))  # disjoint and complete
    single = _rank_batches(data, B * world, A, 0, 1, 10)
    for step in range(10):
        mine = {int(t) for r in per_rank for b in r[step * A : (step + 1) * A] for t in b[:, 0]}
        assert mine == {int(t) for b in single[step * A : (step + 1) * A] for t in b[:, 0]}
    assert next_first(0, B, A, 0, world) == (world * B if A > 1 else B * A * world)


def test_prefetcher_resumes_with_the_same_batches(tmp_path):
    data = _synthetic(tmp_path / "c", 8 * 300 + 1).windows("train", 8, seed=5)
    B, A, world = 3, 2, 2
    for rank in range(world):
        full = _rank_batches(data, B, A, rank, world, 40)  # past one epoch (300 windows)
        resumed = _rank_batches(data, B, A, rank, world, 25, start_step=15)
        assert all(torch.equal(a, b) for a, b in zip(full[15 * A :], resumed))
        assert all(torch.equal(a, data.batch(s * B * A * world + (m * world + rank) * B, B))
                   for (s, m), a in zip([(s, m) for s in range(40) for m in range(A)], full))
    loader = Prefetcher(data, B, A, 0, world)
    assert torch.equal(loader.batch(1), data.batch(1, B))  # off this rank's schedule: built on the spot
    assert torch.equal(loader.batch(0), data.batch(0, B)) and torch.equal(loader.batch(0), data.batch(0, B))
    loader.close()


def test_prefetcher_passes_errors_on():
    class Broken(PackedSequences):
        def batch(self, first, count):
            raise RuntimeError(f"cannot read {first}")

    loader = Prefetcher(Broken(np.arange(100, dtype=np.uint16), 4), 2)
    with pytest.raises(RuntimeError, match="cannot read 0"):
        loader.batch(0)
    with pytest.raises(RuntimeError, match="cannot read 2"):
        loader.batch(2)


def test_prefetch_threads_are_stopped_at_exit(tmp_path):
    """A Prefetcher left open registers its thread, and the exit hook stops and joins it (a
    daemon thread inside torch while the process tears down aborted a script at its end); a
    closed one leaves nothing registered."""
    from twell.recipe import data as D

    data = _synthetic(tmp_path / "c", 8 * 50 + 1).windows("train", 8, seed=1)
    loader = Prefetcher(data, 2, depth=2)
    loader.batch(0)
    thread = loader._thread
    assert thread.is_alive() and (loader._stop, thread) in D._LIVE
    D._stop_all()
    assert not thread.is_alive() and not D._LIVE
    closed = Prefetcher(data, 2)
    closed.batch(0)
    closed.close()
    assert not D._LIVE


EXIT_SCRIPT = r"""
import atexit
state = {}
# registered before twell's hook, so it runs after it (atexit runs the last registered first)
atexit.register(lambda: print("stopped" if not state["thread"].is_alive() else "alive", flush=True))
import numpy as np
from twell.recipe.data import PackedSequences, Prefetcher
loader = Prefetcher(PackedSequences(np.arange(5000, dtype=np.uint16), 8), 4, depth=2)
loader.batch(0)
state["thread"] = loader._thread
"""


def test_an_open_prefetcher_is_stopped_when_the_script_ends():
    run = subprocess.run([sys.executable, "-c", EXIT_SCRIPT], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    assert run.stdout.strip().splitlines()[-1] == "stopped"


def test_raw_streams_keep_their_randperm_order(tmp_path):
    tokens = np.arange(1001, dtype=np.uint16)
    train, val = load_corpus(["unused"], None, 10, seed=3, streams=(tokens, tokens))
    want = torch.stack([torch.from_numpy(tokens[i * 10 : i * 10 + 11].astype(np.int64))
                        for i in torch.randperm(100, generator=torch.Generator().manual_seed(3)).tolist()])
    assert train.order == "randperm" and torch.equal(train.batch(0, 100), want)


# --- training on a prepared folder ---------------------------------------------------------


def test_train_on_a_prepared_folder_resumes_exactly(tmp_path):
    (tmp_path / "src").mkdir()
    _prepare(small_corpus(tmp_path / "src"), tmp_path / "prepared", val_fraction=0.2)
    common = dict(steps=4, log_every=1, eval_every=2, save_every=2, grad_accum=2, data=[str(tmp_path / "prepared")])
    from twell.recipe.trainer import Trainer

    full = Trainer(config(tmp_path, **common, out=str(tmp_path / "full")))
    assert isinstance(full.train_data.tokens, ShardedTokens) and full.train_data.order == "feistel"
    full.fit()
    resumed = Trainer(config(tmp_path, **common, out=str(tmp_path / "resumed")),
                      resume=str(tmp_path / "full" / "checkpoints" / "step_000002"))
    resumed.fit()
    a = {r["step"]: r for r in read_history(tmp_path / "full" / "log.csv")}
    b = {r["step"]: r for r in read_history(tmp_path / "resumed" / "log.csv")}
    assert sorted(b) == [3, 4]
    for step in (3, 4):
        for key in ("ce", "l1", "loss", "active_mean"):
            assert a[step][key] == b[step][key], (step, key)
    assert a[4]["val_loss"] == b[4]["val_loss"]


def test_cli_prepare_train_eval(tmp_path, capsys):
    from test_train_cli import FAST

    (tmp_path / "src").mkdir()
    src = small_corpus(tmp_path / "src")
    main(["data", "prepare", src, "--out", str(tmp_path / "p"), "--val-fraction", "0.2", "--no-progress"])
    printed = capsys.readouterr().out
    assert "documents" in printed and "split by key" in printed and (tmp_path / "p" / INDEX_NAME).is_file()
    out = tmp_path / "run"
    main(["train", *FAST, "--data", str(tmp_path / "p"), "--steps", "2", "--log-every", "1", "--out", str(out)])
    assert f"data {tmp_path / 'p'}" in capsys.readouterr().out
    main(["eval", str(out), "--json", "--val-batches", "2"])
    summary = json.loads((out / "summary.json").read_text())
    assert json.loads(capsys.readouterr().out)["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)


# --- a 2 GB corpus -------------------------------------------------------------------------

BIG = r"""
import json, os, resource, sys, time
from pathlib import Path
import numpy as np

def status(field):
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024

from twell.recipe.data import Prefetcher
from twell.recipe.shards import PreparedCorpus, ShardWriter, finish_corpus, prepare_corpus

root = Path(sys.argv[1])
base = status("VmRSS")
r = {"base": base}

# 1. 2 GiB of tokens through the shard writer (what prepare does after tokenizing), written
#    directly: 2^30 uint16 tokens in documents of 4096, one chunk in 50 to validation.
t0 = time.perf_counter()
out, chunk, doc = root / "big", 1 << 24, 4096
out.mkdir()
train, val = (ShardWriter(out, s, np.dtype("<u2"), 1 << 28) for s in ("train", "validation"))
pattern = np.random.default_rng(0).integers(0, 256, size=chunk, dtype=np.uint16)
pattern[doc - 1 :: doc] = 256
for c in range((1 << 30) // chunk):
    (val if c % 50 == 7 else train).add(pattern, np.full(chunk // doc, doc))
finish_corpus(out, "bytes", train, val, 0.02, documents=(1 << 30) // doc)
r["write_s"] = time.perf_counter() - t0
r["bytes"] = sum(p.stat().st_size for p in out.glob("*.bin"))

# 2. the real prepare (two tokenizing processes) on 32 MB of text
text = root / "text"
text.mkdir()
line = "def f(x):\n    return x * 2  # a line of code\n"
for i in range(8):
    (text / f"{i}.py").write_text(f"# file {i}\n" + line * ((4 << 20) // len(line)))
t0 = time.perf_counter()
small = prepare_corpus([str(text)], "bytes", root / "small", val_fraction=0.1, workers=2, progress=False)
r["prepare_s"], r["prepare_tokens"] = time.perf_counter() - t0, small["tokens"]

# 3. read it all in stream order, then 100k windows of 1024 in the training order
corpus = PreparedCorpus(out)
tokens = corpus.tokens("train")
t0 = time.perf_counter()
eos = sum(int((tokens[a : a + chunk] == 256).sum()) for a in range(0, len(tokens), chunk))
r["scan_s"], r["eos"], r["train_docs"] = time.perf_counter() - t0, eos, corpus.index["splits"]["train"]["documents"]
data = corpus.windows("train", 1024, seed=0)
loader = Prefetcher(data, 64)
t0 = time.perf_counter()
for i in range(100_000 // 64):
    assert loader.batch(i * 64).shape == (64, 1025)
r["windows"], r["read_s"] = (100_000 // 64) * 64, time.perf_counter() - t0
r["hwm"], r["children_hwm"] = status("VmHWM"), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
print(json.dumps(r))
"""


def test_two_gigabyte_corpus_with_bounded_memory(tmp_path):
    """Writing, preparing and reading a corpus of 2 GiB of tokens keeps the process's peak
    resident memory within 256 MiB of what it held after its imports (and under 1 GiB)."""
    try:
        run = subprocess.run([sys.executable, "-c", BIG, str(tmp_path)], capture_output=True, text=True, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        r = json.loads(run.stdout.strip().splitlines()[-1])
    finally:
        shutil.rmtree(tmp_path / "big", ignore_errors=True)  # 2 GB: do not leave it to pytest's cleanup
    MiB = 1 << 20
    print({k: round(v / MiB, 1) if k in ("base", "hwm", "children_hwm", "bytes") else v for k, v in r.items()})
    assert r["bytes"] >= 2 << 30 and r["eos"] == r["train_docs"] and r["prepare_tokens"] > 30e6
    assert r["hwm"] - r["base"] < 256 * MiB and r["hwm"] < 1024 * MiB
    assert r["children_hwm"] < 1024 * MiB
