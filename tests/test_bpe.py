"""twell data tokenizer (twell.recipe.bpe): a byte-level BPE learnt from a corpus's training split,
saved as a Hugging Face fast tokenizer that twell's loading, twell data prepare and twell train
take, the same on every run."""

import json

import pytest
from transformers import AutoTokenizer

from test_train_loss import SHAPE, small_corpus
from twell.cli import main
from twell.recipe.bpe import EOS_TOKEN, INFO_NAME, train_bpe, training_sample
from twell.recipe.data import HFTokenizer, is_validation, iter_documents, load_tokenizer
from twell.recipe.shards import prepare_corpus
from twell.recipe.trainer import TrainConfig, Trainer

PROBE = "def main(x):\n    return x ** 2  # caf\u00e9 \u2013 \u00fcber 12345 \U0001f600\n\n\tThe End."


@pytest.fixture
def corpus(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    return small_corpus(data)


def test_the_tokenizer_loads_in_twell_and_transformers_and_encodes_losslessly(tmp_path, corpus):
    info = train_bpe([corpus], tmp_path / "tok", vocab_size=400, val_fraction=0.2)
    assert info["vocab_size"] == 400 and info["eos_token"] == EOS_TOKEN
    assert json.loads((tmp_path / "tok" / INFO_NAME).read_text()) == info
    tok = load_tokenizer(str(tmp_path / "tok"))
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 400 and tok.eos_id == info["eos_id"]
    assert tok.decode(tok.encode(PROBE)) == PROBE
    assert tok.encode(PROBE).max() < 400 and info["eos_id"] not in tok.encode(PROBE).tolist()
    text = "def f3(x):\n    return x * 3 + 9\n"
    assert len(tok.encode(text)) <= len(text.encode()) / 2  # merges were learnt from the corpus
    hf = AutoTokenizer.from_pretrained(tmp_path / "tok")
    assert hf.eos_token == EOS_TOKEN and hf(PROBE, add_special_tokens=False)["input_ids"] == tok.encode(PROBE).tolist()


def test_training_reads_the_training_split_alone_within_the_budget(tmp_path, corpus):
    every = [(k, t) for k, t in iter_documents([corpus]) if not is_validation(k, 0.2)]
    assert 0 < len(every) < len(list(iter_documents([corpus])))
    assert training_sample([corpus], None, 0.2) == sorted(every)
    budget = sum(len(t) for _, t in every) // 3
    sample = training_sample([corpus], budget, 0.2)
    assert 0 < len(sample) < len(every) and sum(len(t) for _, t in sample) <= budget
    assert set(sample) <= set(every)
    # a prefix of one fixed order: a smaller budget keeps a subset of a larger one's documents
    assert set(training_sample([corpus], budget // 2, 0.2)) <= set(sample)


def test_the_tokenizer_depends_only_on_the_documents(tmp_path, corpus):
    """The same documents through two sources in either order: the same sample and tokenizer."""
    files = sorted(p for p in (tmp_path / "data").iterdir())
    first, second = tmp_path / "a", tmp_path / "b"
    first.mkdir(), second.mkdir()
    for i, path in enumerate(files):
        (first if i % 2 else second).joinpath(path.name).write_text(path.read_text())
    budget = 60_000
    assert training_sample([str(first), str(second)], budget) == training_sample([str(second), str(first)], budget)
    a = train_bpe([str(first), str(second)], tmp_path / "t1", vocab_size=300, max_chars=budget)
    b = train_bpe([str(second), str(first)], tmp_path / "t2", vocab_size=300, max_chars=budget)
    assert a["sha256"] == b["sha256"]
    assert (tmp_path / "t1" / "tokenizer.json").read_text() == (tmp_path / "t2" / "tokenizer.json").read_text()


def test_prepare_and_train_take_the_tokenizer(tmp_path, corpus):
    train_bpe([corpus], tmp_path / "tok", vocab_size=320, val_fraction=0.2)
    index = prepare_corpus([corpus], str(tmp_path / "tok"), tmp_path / "prepared", val_fraction=0.2, workers=0,
                           progress=False)
    assert index["tokenizer"]["vocab_size"] == 320 and index["dtype"] == "uint16"
    shape = {**SHAPE, "steps": 2, "log_every": 1, "seq_len": 16}
    prepared = Trainer(TrainConfig(**shape, data=[str(tmp_path / "prepared")], out=str(tmp_path / "run")))
    raw = Trainer(TrainConfig(**shape, data=[corpus], tokenizer=str(tmp_path / "tok"), val_fraction=0.2,
                              out=str(tmp_path / "raw")))
    assert prepared.config.vocab_size == raw.config.vocab_size == 320  # (rounded up to 64s: already)
    # the same split and ids whichever way the corpus comes
    assert prepared.val_data.tokens[:].tolist() == raw.val_data.tokens.tolist()
    summary = prepared.fit()
    saved = load_tokenizer(summary["checkpoint"])  # the checkpoint brings it along
    assert saved.vocab_size == 320 and saved.encode(PROBE).tolist() == load_tokenizer(str(tmp_path / "tok")).encode(PROBE).tolist()


def test_the_command_line(tmp_path, corpus, capsys):
    main(["data", "tokenizer", corpus, "--out", str(tmp_path / "tok"), "--vocab-size", "300", "--max-mb", "0.05"])
    printed = capsys.readouterr().out
    assert f"{tmp_path / 'tok'}: byte-level BPE of 300 ids" in printed and "--tokenizer" in printed
    info = json.loads((tmp_path / "tok" / INFO_NAME).read_text())
    assert info["max_chars"] == 50_000 and info["chars"] <= 50_000


@pytest.mark.parametrize("argv, message", [
    (["--vocab-size", "257"], r"vocab_size must be >= 258"),
    (["--max-mb", "-1"], r"--max-mb must be >= 0"),
    (["--val-fraction", "1"], r"val_fraction must be in \(0, 1\)"),
])
def test_bad_arguments_are_clear_errors(tmp_path, corpus, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["data", "tokenizer", corpus, "--out", str(tmp_path / "tok"), *argv])
    assert not (tmp_path / "tok").exists()


def test_an_output_folder_with_files_is_refused(tmp_path, corpus):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "x").write_text("")
    with pytest.raises(SystemExit, match="exists and is not an empty folder"):
        main(["data", "tokenizer", corpus, "--out", str(tmp_path / "tok")])
