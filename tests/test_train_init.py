"""twell train --init-from: a run that starts from a Hugging Face model folder (its weights,
architecture and tokenizer), converts its MLPs to ReLU, ramps lambda up, resumes from its own
checkpoints and exports like a run from scratch."""

import json
import shutil

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

from test_train_loss import SHAPE, small_corpus
from twell.cli import main
from twell.recipe.cli import eval_main, train_main
from twell.recipe.config import TrainConfig
from twell.recipe.data import ByteTokenizer
from twell.recipe.model import build_model
from twell.recipe.report import read_history
from twell.recipe.trainer import Trainer

TINY = dict(vocab_size=260, hidden_size=32, intermediate_size=88, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=64)
# the run's options, without the model's shape (the folder's)
RUN = {k: v for k, v in SHAPE.items() if k not in ("preset", "hidden_size", "intermediate_size", "num_layers", "num_heads")}


def dense_folder(path, act="silu", seed=0) -> str:
    """A tiny LlamaForCausalLM (random weights, ``act`` MLPs) saved with save_pretrained, with a
    byte-level fast tokenizer beside it: what any Hugging Face model folder holds."""
    torch.manual_seed(seed)
    LlamaForCausalLM(LlamaConfig(hidden_act=act, **TINY)).save_pretrained(path)
    ByteTokenizer().as_hf().save_pretrained(path)
    return str(path)


def init_config(tmp_path, folder, **kw) -> TrainConfig:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return TrainConfig(**{**RUN, "init_from": folder, "data": [small_corpus(data)], "out": str(tmp_path / "run"),
                          "val_fraction": 0.2, **kw})


def cross_entropy(model, batch) -> torch.Tensor:
    logits = model(input_ids=batch[:, :-1], use_cache=False).logits
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))


def test_build_model_refuses_a_model_that_is_not_relu():
    """A SiLU model reaches training only through a conversion asked for, never swapped in passing."""
    config = LlamaConfig(vocab_size=64, hidden_size=16, intermediate_size=40, num_hidden_layers=1,
                         num_attention_heads=2, hidden_act="silu")
    with pytest.raises(ValueError, match=r"MLPs use silu, not ReLU.*--init-from"):
        build_model(config)
    config.hidden_act = "relu"
    assert build_model(config).config.hidden_act == "relu"


def test_the_first_step_trains_the_folders_weights_with_relu(tmp_path):
    """The first step's loss is the loaded model's with ReLU in place of SiLU, on the same batch:
    the weights are the folder's, converted; the architecture and tokenizer too."""
    folder = dense_folder(tmp_path / "dense")
    t = Trainer(init_config(tmp_path, folder, steps=4))
    assert t.config.hidden_act == "relu" and t.converted_from == "silu"
    assert (t.config.hidden_size, t.config.num_hidden_layers, t.config.vocab_size) == (32, 2, 260)
    assert t.tokenizer.vocab_size == 257 and t.tokenizer.eos_id == 256 and t.cfg.preset is None
    batch = t.micro_batch(0)
    with torch.no_grad():
        relu = LlamaForCausalLM.from_pretrained(folder, hidden_act="relu", dtype=torch.float32)
        silu = LlamaForCausalLM.from_pretrained(folder, dtype=torch.float32)
        want, unconverted = cross_entropy(relu, batch), cross_entropy(silu, batch)
    r = t.train_step()
    torch.testing.assert_close(r.ce, want, rtol=1e-5, atol=1e-6)
    assert abs(float(r.ce) - float(unconverted)) > 1e-4  # the swap changed the function: it did happen
    before = relu.model.layers[0].mlp.gate_proj.weight
    assert not torch.equal(t.model.model.layers[0].mlp.gate_proj.weight.detach(), before)  # and it trains


def test_resume_continues_from_the_checkpoint_not_the_folder(tmp_path):
    """A resumed --init-from run ends as the uninterrupted one, with the folder it started from
    gone: weights, architecture and tokenizer come from the checkpoint."""
    folder = dense_folder(tmp_path / "dense")
    common = dict(steps=6, log_every=1, eval_every=3, save_every=3, l1=0.05, l1_warmup=4)
    full = Trainer(init_config(tmp_path, folder, **common, out=str(tmp_path / "full")))
    full.fit()
    saved = json.loads((tmp_path / "full" / "checkpoints" / "step_000003" / "train_config.json").read_text())
    assert saved["init_from"] == str((tmp_path / "dense").resolve()) and saved["preset"] is None
    shutil.rmtree(folder)
    resumed = Trainer(init_config(tmp_path, folder, **common, out=str(tmp_path / "resumed")),
                      resume=str(tmp_path / "full" / "checkpoints" / "step_000003"))
    assert resumed.step == 3 and resumed.converted_from is None
    resumed.fit()
    a = {r["step"]: r for r in read_history(tmp_path / "full" / "log.csv")}
    b = {r["step"]: r for r in read_history(tmp_path / "resumed" / "log.csv")}
    for step in (4, 5, 6):
        for key in ("ce", "l1", "loss", "lr", "lambda"):
            assert a[step][key] == b[step][key], (step, key)
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n


def test_cli_run_then_eval_and_export_load_in_transformers(tmp_path, capsys):
    folder = dense_folder(tmp_path / "dense")
    data = tmp_path / "data"
    data.mkdir()
    out, hf = tmp_path / "run", tmp_path / "hf"
    summary = train_main(["--init-from", folder, "--data", small_corpus(data), "--val-fraction", "0.2",
                    "--steps", "4", "--log-every", "2", "--batch-size", "4", "--val-batches", "2",
                    "--no-progress", "--no-plot", "--out", str(out)])
    printed = capsys.readouterr().out
    assert f"twell train: from {(tmp_path / 'dense').resolve()}" in printed and "ramped up over 1 steps" in printed
    assert "its MLPs used silu; they train with ReLU" in printed
    assert summary["init_from"] == str((tmp_path / "dense").resolve()) and summary["l1_warmup"] == 1
    assert summary["seq_len"] == 64  # the folder's context

    result = eval_main([str(out), "--json"])
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    capsys.readouterr()
    main(["export", str(out), str(hf)])
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    tok = AutoTokenizer.from_pretrained(hf)
    assert model.config.hidden_act == "relu" and tok("hi")["input_ids"] == [104, 105]
    trained = AutoModelForCausalLM.from_pretrained(out / "checkpoints" / "step_000004", dtype=torch.float32).eval()
    ids = torch.tensor([tok("def f(x):")["input_ids"]])
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, trained(ids).logits)

    # the command line resumes it with the run's saved settings, the folder it started from gone
    shutil.rmtree(folder)
    resumed = train_main(["--resume", str(out), "--steps", "6", "--no-progress", "--no-plot"])
    assert resumed["steps"] == 6 and resumed["init_from"] == summary["init_from"] and resumed["seq_len"] == 64


def test_a_qwen2_folder_trains_and_exports(tmp_path):
    """Not only Llama: any causal LM whose MLPs have gate_proj, up_proj and down_proj."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(hidden_act="silu", num_key_value_heads=1, **TINY)).save_pretrained(tmp_path / "qwen")
    ByteTokenizer().as_hf().save_pretrained(tmp_path / "qwen")
    summary = Trainer(init_config(tmp_path, str(tmp_path / "qwen"), steps=2, log_every=1)).fit()
    main(["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    assert type(AutoModelForCausalLM.from_pretrained(tmp_path / "hf")).__name__ == "Qwen2ForCausalLM"
    assert len(summary["active_per_token_by_layer"]) == 2


def test_a_checkpoint_whose_model_is_not_relu_is_refused_on_resume(tmp_path):
    folder = dense_folder(tmp_path / "dense")
    Trainer(init_config(tmp_path, folder, steps=2, log_every=1)).fit()
    step = tmp_path / "run" / "checkpoints" / "step_000002"
    config = json.loads((step / "config.json").read_text())
    (step / "config.json").write_text(json.dumps({**config, "hidden_act": "silu"}))
    with pytest.raises(ValueError, match="MLPs use silu, not ReLU"):
        Trainer(init_config(tmp_path, folder, steps=4), resume=str(step))


@pytest.mark.parametrize("argv, message", [
    (["--hidden-size", "64"], r"--hidden-size 64 conflicts with --init-from .*, whose hidden_size is 32"),
    (["--num-layers", "3"], r"--num-layers 3 conflicts with .* num_hidden_layers is 2"),
    (["--preset", "small"], r"--init-from brings the model and its tokenizer: leave out --preset"),
    (["--preset", "tiny", "--tokenizer", "bytes"], r"leave out --preset and --tokenizer"),
    (["--seq-len", "128"], r"--seq-len 128 is longer than the context .* \(max_position_embeddings 64\)"),
    (["--fsdp"], r"--init-from with --fsdp is not supported"),
    (["--resume", "somewhere"], r"--init-from starts a run .* --resume continues one"),
])
def test_conflicting_options_are_clear_errors(tmp_path, argv, message):
    folder = dense_folder(tmp_path / "dense")
    with pytest.raises(SystemExit, match=message):
        main(["train", "--init-from", folder, "--out", str(tmp_path / "run"), *argv])


def test_equal_sizes_are_accepted(tmp_path):
    folder = dense_folder(tmp_path / "dense")
    cfg = TrainConfig(init_from=folder, hidden_size=32, num_heads=2).resolved()
    assert cfg.hidden_size is None and cfg.tokenizer == cfg.init_from and cfg.seq_len == 64 and cfg.lr == 1e-4


def test_folders_that_cannot_start_a_run_are_named(tmp_path):
    folder = dense_folder(tmp_path / "dense")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        (tmp_path / "dense" / name).unlink()
    with pytest.raises(ValueError, match="holds no tokenizer"):
        TrainConfig(init_from=folder).resolved()
    (tmp_path / "dense" / "model.safetensors").unlink()
    with pytest.raises(ValueError, match="holds no weights"):
        TrainConfig(init_from=folder).resolved()
    with pytest.raises(ValueError, match="no such folder"):
        TrainConfig(init_from=str(tmp_path / "nothing")).resolved()
    with pytest.raises(ValueError, match="holds no config.json"):
        TrainConfig(init_from=str(tmp_path)).resolved()


def test_a_tokenizer_larger_than_the_embedding_is_refused_before_the_data(tmp_path):
    folder = dense_folder(tmp_path / "dense")
    config = json.loads((tmp_path / "dense" / "config.json").read_text())
    (tmp_path / "dense" / "config.json").write_text(json.dumps({**config, "vocab_size": 200}))
    with pytest.raises(ValueError, match="has 257 ids, more than the 200 rows"):
        Trainer(init_config(tmp_path, folder, data=[str(tmp_path / "no-such-corpus")]))


def test_the_lambda_ramp_follows_its_schedule(tmp_path):
    """With --init-from lambda ramps up linearly over a quarter of the run by default; from
    scratch it does not (the default stays 0)."""
    folder = dense_folder(tmp_path / "dense")
    assert TrainConfig(steps=20).resolved().l1_warmup == 0
    assert TrainConfig(init_from=folder, steps=20).resolved().l1_warmup == 5
    assert TrainConfig(init_from=folder, steps=20, l1_warmup=0).resolved().l1_warmup == 0
    t = Trainer(init_config(tmp_path, folder, steps=8, l1=0.04, log_every=1))
    assert t.cfg.l1_warmup == 2
    t.fit()
    rows = read_history(tmp_path / "run" / "log.csv")
    assert [r["lambda"] for r in rows] == pytest.approx([0.02, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04, 0.04])


def _word_tokenizer(path) -> None:
    """A tokenizer unlike the byte one: a few whole words, the rest unknown."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = ["[UNK]", "</s>", "def", "return", "x", "(", ")", ":"]
    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="[UNK]").save_pretrained(path)


def test_a_prepared_corpus_must_hold_the_models_tokens(tmp_path, monkeypatch):
    """A corpus prepared with the model's tokenizer, named as it was then (here a relative path),
    trains; one prepared with another tokenizer is refused, naming the fix."""
    from twell.recipe.data_cli import data_main

    folder = dense_folder(tmp_path / "dense")
    data = tmp_path / "data"
    data.mkdir()
    monkeypatch.chdir(tmp_path)
    data_main(["prepare", small_corpus(data), "--tokenizer", "dense", "--out", "prepared", "--val-fraction", "0.2",
               "--no-progress"])
    t = Trainer(init_config(tmp_path, folder, data=["prepared"], steps=1))
    assert t.tokenizer.vocab_size == 257 and len(t.train_data) > 0
    _word_tokenizer(tmp_path / "words")
    data_main(["prepare", str(data), "--tokenizer", "words", "--out", "other", "--no-progress"])
    with pytest.raises(ValueError, match=r"--data other was prepared with the tokenizer .* prepare it with --tokenizer"):
        Trainer(init_config(tmp_path, folder, data=["other"], steps=1))
