"""`twell train` and `twell eval` from the command line, a few steps."""

import json

import pytest

from test_train_loss import small_corpus
from twell.cli import main
from twell.recipe.report import read_history

# No progress bar and no training.png: drawing the plot takes about a second of CPU per run
# (test_train_then_eval draws it).
FAST = ["--hidden-size", "32", "--intermediate-size", "88", "--num-layers", "2", "--num-heads", "2",
        "--seq-len", "32", "--batch-size", "4", "--val-batches", "2", "--no-progress", "--no-plot"]


def test_train_then_eval(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "run"
    with_plot = [a for a in FAST if a != "--no-plot"]
    main(["train", *with_plot, "--data", small_corpus(data), "--val-fraction", "0.2", "--steps", "6",
          "--log-every", "2", "--dead-window", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "== summary" in printed and "active units per token" in printed and "validation loss" in printed
    for name in ("log.csv", "training.png", "summary.json", "checkpoints/step_000006/model.safetensors",
                 "checkpoints/step_000006/optimizer.safetensors", "checkpoints/step_000006/config.json"):
        assert (out / name).is_file(), name
    rows = read_history(out / "log.csv")
    assert [r["step"] for r in rows] == [2, 4, 6] and "active_mean_L1" in rows[0] and "val_loss" in rows[-1]
    # each layer's dead share: over the training window in every row, on the validation tokens in validation rows
    assert all("dead_frac_L1" in r and "dead_frac_val_L1" in r for r in rows)  # (validation at every log row here)
    assert all(r["sparse_layers"] == 0 for r in rows)  # "auto" on the CPU: the plain math in every layer
    summary = json.loads((out / "summary.json").read_text())
    assert len(summary["active_per_token_by_layer"]) == 2 and summary["tokens"] == 6 * 4 * 32
    assert len(summary["dead_frac_val_by_layer"]) == len(summary["dead_frac_window_max_by_layer"]) == 2
    assert "most dead (window)" in printed

    main(["eval", str(out), "--json", "--val-batches", "2"])
    result = json.loads(capsys.readouterr().out)
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)
    assert 0 <= result["sparsity"] <= 1 and len(result["active_per_token_by_layer"]) == 2


def test_default_corpus_a_few_steps(tmp_path, capsys):
    """The no-argument path: the standard library corpus (shrunk model, 2 steps)."""
    main(["train", *FAST, "--steps", "2", "--out", str(tmp_path)])
    assert "data stdlib" in capsys.readouterr().out


def test_help_documents_the_l1_convention(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "SUM over the f hidden units" in capsys.readouterr().out


@pytest.mark.parametrize("argv, message", [
    (["--steps", "0"], r"steps \(--steps\) must be >= 1, got 0"),
    (["--l1", "-1"], "L1 coefficient"),
    (["--log-every", "0"], r"^twell train: log_every \(--log-every\) must be >= 1, got 0$"),
    (["--num-heads", "0"], r"^twell train: num_heads \(--num-heads\) must be >= 1, got 0$"),
    (["--save-every", "0"], r"save_every \(--save-every\) must be >= 1, got 0"),
    (["--data", "/no/such/file.txt"], "no such file"),
    (["--resume", "/no/such/run"], "no checkpoint"),
])
def test_bad_arguments_are_clear_errors(tmp_path, argv, message):
    with pytest.raises(SystemExit, match=message):
        main(["train", *FAST, "--out", str(tmp_path), *argv])


def test_unknown_preset_is_rejected(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--preset", "huge"])
    assert "invalid choice" in capsys.readouterr().err


def test_resume_with_new_lr_and_weight_decay_applies_them(tmp_path):
    """--lr and --weight-decay given with --resume override the checkpoint's (as --help says),
    in the optimizer and in the scheduler, which would otherwise keep the saved values."""
    from twell.recipe.trainer import Trainer, TrainConfig

    out = tmp_path / "run"
    data = tmp_path / "data"
    data.mkdir()
    base = [*FAST, "--data", small_corpus(data), "--val-fraction", "0.2", "--log-every", "1", "--warmup", "1",
            "--min-lr-ratio", "1", "--out", str(out)]  # constant lr after warm-up: the logged lr is --lr
    main(["train", *base, "--steps", "2", "--lr", "1e-3", "--weight-decay", "0.1"])
    main(["train", "--resume", str(out), "--steps", "4", "--lr", "4e-3", "--weight-decay", "0.05"])
    lrs = {r["step"]: r["lr"] for r in read_history(out / "log.csv")}
    assert lrs[2] == pytest.approx(1e-3) and lrs[3] == pytest.approx(4e-3) and lrs[4] == pytest.approx(4e-3)

    cfg = TrainConfig(**{**json.loads((out / "checkpoints" / "step_000004" / "train_config.json").read_text()),
                         "steps": 6, "weight_decay": 0.02})
    t = Trainer(cfg, resume=str(out))
    assert [g["weight_decay"] for g in t.optimizer.param_groups] == [0.02, 0.0]
    assert [g["lr"] for g in t.optimizer.param_groups] == [4e-3, 4e-3] and t.scheduler.base_lrs == [4e-3, 4e-3]


def test_jsonl_without_the_text_field_is_a_clear_error(tmp_path):
    (tmp_path / "d.jsonl").write_text(json.dumps({"body": "x" * 100}) + "\n")
    with pytest.raises(SystemExit, match=r"^twell train: .*d.jsonl:1: expected a field 'text', the row has \['body'\]"):
        main(["train", *FAST, "--out", str(tmp_path / "run"), "--data", str(tmp_path / "d.jsonl")])


def test_a_tokenizer_that_cannot_be_loaded_is_a_clear_error(tmp_path, monkeypatch):
    """A hub name with no network (and not cached) or a wrong name: one line, not transformers'
    traceback (twell train, twell data prepare)."""
    import transformers

    def offline(name, *a, **k):
        raise OSError(f"We couldn't connect to 'https://huggingface.co' to load {name}.\nCheck your connection.")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    (tmp_path / "d.jsonl").write_text(json.dumps({"text": "x" * 100}) + "\n")
    line = r"tokenizer 'org/tok' could not be loaded: We couldn't connect to 'https://huggingface.co' to load org/tok\. \("
    with pytest.raises(SystemExit, match="^twell train: " + line):
        main(["train", *FAST, "--out", str(tmp_path / "run"), "--data", str(tmp_path / "d.jsonl"), "--tokenizer", "org/tok"])
    with pytest.raises(SystemExit, match="^twell data prepare: " + line):
        main(["data", "prepare", str(tmp_path / "d.jsonl"), "--out", str(tmp_path / "prep"), "--tokenizer", "org/tok"])
    monkeypatch.undo()
    main(["train", *FAST, "--out", str(tmp_path / "run"), "--steps", "1"])  # byte tokens
    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", offline)
    with pytest.raises(SystemExit, match="^twell eval: " + line):
        main(["eval", str(tmp_path / "run"), "--tokenizer", "org/tok"])
    bad = tmp_path / "bad"  # a checkpoint's tokenizer file that is not one: the error names it
    bad.mkdir()
    (bad / "twell_tokenizer.json").write_text("{not json")
    with pytest.raises(SystemExit, match=r"^twell eval: .*bad/twell_tokenizer\.json: not a twell tokenizer file"):
        main(["eval", str(tmp_path / "run"), "--tokenizer", str(bad)])


def test_cuda_without_a_gpu_is_a_clear_error(tmp_path):
    import torch

    if torch.cuda.is_available():
        pytest.skip("a GPU is there")
    with pytest.raises(SystemExit, match="^twell train: device 'cuda' asked for, but torch sees no CUDA GPU; use --device cpu$"):
        main(["train", *FAST, "--out", str(tmp_path), "--device", "cuda"])
    with pytest.raises(SystemExit, match="no CUDA GPU"):
        main(["eval", str(tmp_path), "--device", "cuda"])


def test_sparsity_sweep_settings_are_valid_for_short_runs():
    """benchmarks/sparsity_sweep.py validates about 4 times per run: at least every step when
    a run has fewer than 4 steps (steps // 4 was 0, which the trainer rejects)."""
    import importlib.util
    from pathlib import Path

    from twell.recipe.trainer import TrainConfig

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "sparsity_sweep.py"
    spec = importlib.util.spec_from_file_location("sparsity_sweep", path)
    sweep = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(sweep)
    for steps, every in ((1, 1), (3, 1), (8, 2), (1150, 287)):
        cfg = sweep.run_config(TrainConfig(device="cpu"), steps, 2e-5, True, "runs").resolved()
        assert cfg.eval_every == every and cfg.out == "runs/l1_2e-05_reinit"


def test_resume_continues_in_the_folder_it_is_given(tmp_path, capsys, monkeypatch):
    """A run copied elsewhere and resumed there writes its checkpoints and log there, not into
    the folder it was started in (which the checkpoint's settings name), also when the
    checkpoint is named relative to the current folder."""
    import shutil

    data = tmp_path / "data"
    data.mkdir()
    first, copy = tmp_path / "first", tmp_path / "copy"
    main(["train", *FAST, "--data", small_corpus(data), "--val-fraction", "0.2", "--log-every", "1",
          "--save-every", "2", "--out", str(first), "--steps", "2"])
    shutil.copytree(first, copy)
    before = {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()}
    monkeypatch.chdir(copy / "checkpoints")
    main(["train", "--resume", "step_000002", "--steps", "4"])
    assert "continuing in" in capsys.readouterr().err
    assert {p: p.stat().st_mtime_ns for p in first.rglob("*") if p.is_file()} == before
    assert (copy / "checkpoints" / "step_000004").is_dir() and not (first / "checkpoints" / "step_000004").exists()
    assert not (copy / "checkpoints" / "step_000002" / "checkpoints").exists()
    assert [r["step"] for r in read_history(copy / "log.csv")] == [1, 2, 3, 4]
    monkeypatch.chdir(tmp_path)
    main(["train", "--resume", str(copy), "--steps", "5"])
    assert (copy / "checkpoints" / "step_000005").is_dir() and not (first / "checkpoints" / "step_000005").exists()
