"""Training runs a user can trust: non-finite steps skipped, Ctrl-C and SIGTERM save and resume
exactly, a kill during a checkpoint write loses nothing, old checkpoints pruned, the log, the
summary and `twell eval` consistent, and the command fast to answer."""

import csv
import json
import math
import os
import re
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from test_train_cli import FAST
from test_train_loss import config, small_corpus
from twell.cli import main
from twell.recipe import checkpoint as ckpt
from twell.recipe.cli import eval_main, train_main
from twell.recipe.report import read_history
from twell.recipe.trainer import RunStopped, Trainer


def _poison_cross_entropy(monkeypatch, bad_calls):
    """Make the training loss NaN on the given (1-based) calls of F.cross_entropy with gradients
    on (validation runs without them and is left alone)."""
    real, calls = F.cross_entropy, {"n": 0}

    def cross_entropy(*args, **kwargs):
        out = real(*args, **kwargs)
        if torch.is_grad_enabled():
            calls["n"] += 1
            if bad_calls(calls["n"]):
                return out * float("nan")
        return out

    monkeypatch.setattr(F, "cross_entropy", cross_entropy)


def _params(trainer):
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def test_a_nan_loss_skips_its_step(tmp_path, monkeypatch):
    _poison_cross_entropy(monkeypatch, lambda n: n == 2)
    t = Trainer(config(tmp_path, steps=4, log_every=1, eval_every=4))
    assert t.train_step().applied
    before, adam_steps = _params(t), [float(s["step"]) for s in t.optimizer.state.values()]
    lr, stats = t.scheduler.get_last_lr(), t.interval.snapshot()
    r = t.train_step()  # the poisoned one
    assert not r.applied and not torch.isfinite(r.ce)
    assert t.step == 1 and t.samples_seen == 2 * 4 and t.skipped == 1 and t.bad_streak == 1
    for n, p in t.model.named_parameters():
        assert torch.equal(p, before[n]), n
        assert p.grad is None, n
    assert [float(s["step"]) for s in t.optimizer.state.values()] == adam_steps and t.scheduler.get_last_lr() == lr
    assert t.interval.tokens == stats[3] and torch.equal(t.interval.active_sum, stats[0])  # its statistics dropped
    assert not t.dead.pending.any()
    # the run goes on; the counter is in the log and the summary
    summary = t.fit()
    assert t.step == 4 and t.samples_seen == 5 * 4 and t.bad_streak == 0 and summary["skipped_steps"] == 1
    assert all(torch.isfinite(p).all() for p in t.model.parameters())
    rows = read_history(tmp_path / "run" / "log.csv")  # fit logged from step 2 on
    assert [(r["step"], r["skipped"]) for r in rows] == [(2, 1), (3, 1), (4, 1)]
    assert rows[0]["grad_norm"] > 0


def test_nan_steps_in_a_row_stop_with_the_last_good_state(tmp_path, monkeypatch, capsys):
    _poison_cross_entropy(monkeypatch, lambda n: n >= 3)  # steps 1 and 2 train, then every step is NaN
    out = tmp_path / "run"
    data = tmp_path / "data"
    data.mkdir()
    argv = ["train", *FAST, "--data", small_corpus(data), "--val-fraction", "0.2", "--steps", "6", "--log-every", "1",
            "--max-bad-steps", "3", "--out", str(out)]
    with pytest.raises(SystemExit) as stop:
        main(argv)
    assert stop.value.code == 1
    captured = capsys.readouterr()
    assert captured.out.count("warning: step 3 skipped: cross entropy nan, L1 ") == 3
    for n in (1, 2, 3):
        assert f"(NaN or Inf; {n} skipped in all, {n} in a row, the run stops at 3)" in captured.out
    err = captured.err.strip().splitlines()
    assert len(err) == 1 and re.fullmatch(
        r"twell train: stopped: the loss or gradient was NaN or Inf 3 steps in a row at step 2 of 6; the last good "
        r"state saved in .*step_000002; resume with a lower learning rate: twell train --resume .* --lr LR", err[0]), err
    # the checkpoint holds step 2's weights, and the data position after the 3 skipped batches
    resumed = Trainer(config(tmp_path, steps=6), resume=str(out))
    assert resumed.step == 2 and resumed.samples_seen == 5 * 4 and resumed.skipped == 3
    assert all(torch.isfinite(p).all() for p in resumed.model.parameters())


def _fork(target, *args, log_dir):
    """Run ``target(*args)`` in a forked process whose stdout and stderr go to files in
    ``log_dir``; returns the process and a function that reads ``(stdout, stderr)``.

    A real, separate process (it gets real signals, exits with its own status, can be killed
    mid-write), forked rather than started fresh: a fresh Python would spend most of these
    tests importing torch and transformers again (about 9 s of a 2-core CPU each). The child
    must not use CUDA (a forked child cannot once its parent has): the tests run on the CPU."""
    import multiprocessing
    import warnings

    paths = log_dir / "stdout.txt", log_dir / "stderr.txt"

    def child():
        for fd, path in zip((1, 2), paths):
            f = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
            os.dup2(f, fd)
            os.close(f)
        sys.stdout, sys.stderr = (open(fd, "w", buffering=1, closefd=False) for fd in (1, 2))
        # OpenMP's worker threads are not forked: a parallel region in the child would wait
        # for them forever (as DataLoader workers do, the child computes on one thread)
        torch.set_num_threads(1)
        target(*args)  # SystemExit(code) ends the process with that status

    proc = multiprocessing.get_context("fork").Process(target=child, daemon=True)
    with warnings.catch_warnings():  # Python >= 3.12 warns about forking with threads (see child)
        warnings.filterwarnings("ignore", "This process .* is multi-threaded", DeprecationWarning)
        proc.start()
    return proc, lambda: tuple(p.read_text() if p.exists() else "" for p in paths)


def _interruptible(ready, step: int, argv: list) -> None:
    """`twell train ARGV`; before step STEP's gradients, write READY and wait for a signal."""
    forward_backward = Trainer.forward_backward

    def waiting(self):
        if self.step + 1 == step and not ready.exists():
            ready.write_text("waiting")
            deadline = time.monotonic() + 120
            while self.stop_signal is None and time.monotonic() < deadline:
                time.sleep(0.02)
        return forward_backward(self)

    Trainer.forward_backward = waiting  # in the child only
    main(argv)


@pytest.fixture
def one_thread():
    """One intra-op thread for the whole test, as in its forked child (see _fork): the runs it
    compares bit for bit then do their arithmetic in the same order on any number of cores."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def test_sigint_saves_and_resume_ends_as_the_uninterrupted_run(tmp_path, one_thread):
    """A real SIGINT sent to a `twell train` process in step 4 of 6: it saves step 4 and prints
    one line; `--resume` then ends with the weights and log of the uninterrupted run."""
    data = tmp_path / "data"
    data.mkdir()
    args = [*FAST, "--data", small_corpus(data), "--val-fraction", "0.2", "--steps", "6", "--log-every", "1",
            "--eval-every", "3", "--l1", "0.05", "--device", "cpu"]  # cpu: the child is forked (see _fork)
    main(["train", *args, "--out", str(tmp_path / "full")])

    out, ready = tmp_path / "interrupted", tmp_path / "ready"
    proc, output = _fork(_interruptible, ready, 4, ["train", *args, "--out", str(out)], log_dir=tmp_path)
    try:
        deadline = time.monotonic() + 120  # to start and train 3 steps
        while not ready.exists() and proc.is_alive() and time.monotonic() < deadline:
            time.sleep(0.02)
        assert ready.exists(), output()
        os.kill(proc.pid, signal.SIGINT)
        proc.join(timeout=120)
    finally:
        proc.kill()
        proc.join()
    stdout, stderr = output()
    assert proc.exitcode == 128 + signal.SIGINT, stderr
    assert "Traceback" not in stderr
    line = stderr.strip().splitlines()[-1]
    assert re.fullmatch(rf"twell train: interrupted by SIGINT at step 4 of 6; checkpoint saved in {out}/checkpoints/"
                        rf"step_000004; resume with: twell train --resume {out}", line), line
    assert "SIGINT: saving a checkpoint at the end of step 4" in stdout

    main(["train", "--resume", str(out)])
    want, got = read_history(tmp_path / "full" / "log.csv"), read_history(out / "log.csv")
    assert [r["step"] for r in got] == [1, 2, 3, 4, 5, 6]
    for w, g in zip(want, got):
        assert w.keys() == g.keys()
        for key in w.keys() - {"tokens_per_s"}:  # dead_frac is NaN before the first window ends
            assert w[key] == g[key] or (math.isnan(w[key]) and math.isnan(g[key])), (w["step"], key)
    a = load_file(str(tmp_path / "full" / "checkpoints" / "step_000006" / "model.safetensors"))
    b = load_file(str(out / "checkpoints" / "step_000006" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def signal_in_step(monkeypatch, step: int, then=None) -> None:
    """SIGTERM this process as step ``step`` (1-based) computes its gradients; ``then(trainer)``,
    if given, runs right after the signal (before the step's work)."""
    forward_backward = Trainer.forward_backward

    def terminated(self):
        if self.step + 1 == step:
            os.kill(os.getpid(), signal.SIGTERM)
            if then is not None:
                then(self)
        return forward_backward(self)

    monkeypatch.setattr(Trainer, "forward_backward", terminated)


def test_sigterm_saves_at_the_end_of_the_step(tmp_path, monkeypatch):
    t = Trainer(config(tmp_path, steps=6, log_every=2, eval_every=6))
    signal_in_step(monkeypatch, 3)
    handler = signal.getsignal(signal.SIGTERM)
    with pytest.raises(RunStopped, match="interrupted by SIGTERM at step 3 of 6") as stop:
        t.fit()
    assert stop.value.exit_code == 128 + signal.SIGTERM and t.step == 3
    assert stop.value.checkpoint == tmp_path / "run" / "checkpoints" / "step_000003"
    assert ckpt.latest_checkpoint(tmp_path / "run") == stop.value.checkpoint
    assert signal.getsignal(signal.SIGTERM) is handler  # the loop's handlers are gone


def _killed_writing(argv: list) -> None:
    """`twell train ARGV`, SIGKILLed halfway through writing its second checkpoint."""
    save_optimizer, calls = ckpt.save_optimizer, []

    def killed(path, osd):
        calls.append(path)
        if len(calls) == 2:
            path.write_bytes(b"half an optimizer state")
            os.kill(os.getpid(), signal.SIGKILL)
        save_optimizer(path, osd)

    ckpt.save_optimizer = killed  # in the child only
    main(argv)


def test_a_kill_during_a_checkpoint_write_leaves_a_loadable_checkpoint(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "run"
    args = [*FAST, "--data", small_corpus(data), "--val-fraction", "0.2", "--steps", "3", "--log-every", "1",
            "--save-every", "1", "--out", str(out), "--device", "cpu"]  # cpu: the child is forked (see _fork)
    proc, output = _fork(_killed_writing, ["train", *args], log_dir=tmp_path)
    proc.join(timeout=300)
    stuck = proc.is_alive()
    proc.kill()
    proc.join()
    assert not stuck and proc.exitcode == -signal.SIGKILL, output()[1]  # killed by itself, not by us
    folders = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert folders == [".step_000002.tmp", "step_000001"]  # the half-written one never got its name
    assert ckpt.latest_checkpoint(out) == out / "checkpoints" / "step_000001"
    main(["train", "--resume", str(out)])
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000001", "step_000002", "step_000003"]
    assert [r["step"] for r in read_history(out / "log.csv")] == [1, 2, 3]


def test_resume_passes_over_incomplete_checkpoints(tmp_path, capsys):
    """Folders written in place by older versions and cut short: the newest complete one is used."""
    import shutil

    Trainer(config(tmp_path, steps=2, log_every=1, eval_every=2, save_every=1, keep=0)).fit()
    run = tmp_path / "run"
    good = run / "checkpoints" / "step_000002"
    for step, damage in ((3, "train_config.json"), (4, "truncate")):
        bad = run / "checkpoints" / f"step_{step:06d}"
        shutil.copytree(good, bad)
        if damage == "truncate":
            data = (bad / "model.safetensors").read_bytes()
            (bad / "model.safetensors").write_bytes(data[: len(data) // 2])
        else:
            (bad / damage).unlink()
    passed_over = []
    assert ckpt.latest_checkpoint(run, passed_over) == good
    assert [(p.name, missing) for p, missing in passed_over] == [("step_000004", ["model.safetensors"]),
                                                                ("step_000003", ["train_config.json"])]
    with pytest.raises(FileNotFoundError, match="incomplete checkpoint .*train_config.json"):
        ckpt.latest_checkpoint(run / "checkpoints" / "step_000003")
    t = Trainer(config(tmp_path, steps=3), resume=str(run))
    assert t.step == 2 and "step_000004 is incomplete" in capsys.readouterr().out


def test_keep_prunes_old_checkpoints(tmp_path):
    run = tmp_path / "run"
    (run / "checkpoints" / "step_000099").mkdir(parents=True)  # a later step of another run: not ours to delete
    Trainer(config(tmp_path, steps=5, log_every=1, eval_every=5, save_every=1, keep=2)).fit()
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_000004", "step_000005", "step_000099"]


def test_wall_time_saves(tmp_path):
    """--save-minutes: a checkpoint whenever that much time has passed since the last one (here
    a few milliseconds, so at every step)."""
    Trainer(config(tmp_path, steps=3, log_every=1, eval_every=3, save_minutes=1e-6, keep=0)).fit()
    assert [p.name for p in ckpt.step_checkpoints(tmp_path / "run")] == ["step_000001", "step_000002", "step_000003"]


def test_log_keeps_integer_columns_across_resume(tmp_path):
    common = dict(log_every=1, eval_every=2, save_every=2)
    Trainer(config(tmp_path, steps=2, **common)).fit()
    cfg = config(tmp_path, steps=4, **common)
    Trainer(cfg, resume=cfg.out).fit()
    with open(tmp_path / "run" / "log.csv", newline="") as fh:
        rows = list(csv.DictReader(fh))
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"]
    for r in rows:
        for key in ("tokens", "skipped", "active_max", "active_max_L0"):
            assert re.fullmatch(r"\d+", r[key]), (key, r[key])


def test_summary_and_progress_bar_show_the_same_throughput(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    argv = ["train", *[a for a in FAST if a != "--no-progress"], "--data", small_corpus(data), "--val-fraction", "0.2",
            "--steps", "4", "--log-every", "2", "--out", str(tmp_path / "run")]
    summary = train_main(argv[1:])
    captured = capsys.readouterr()
    bar = re.findall(r"([\d,]+) tok/s", captured.err)[-1]
    said = re.search(r"throughput ([\d,]+) tokens/s", captured.out).group(1)
    assert bar == said == f"{summary['tokens_per_s']:,.0f}"


def test_eval_reports_what_training_reported(tmp_path, capsys):
    """With no options `twell eval` reads the windows the run's validation read: the same loss on
    the same tokens, and both say what they measured."""
    data = tmp_path / "data"
    data.mkdir()
    out = tmp_path / "run"
    summary = train_main([*FAST, "--data", small_corpus(data), "--val-fraction", "0.2", "--steps", "3",
                    "--log-every", "1", "--val-batches", "3", "--out", str(out)])
    trained = capsys.readouterr().out
    result = eval_main([str(out)])
    evaluated = capsys.readouterr().out
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-6, abs=0)
    assert result["tokens"] == summary["val_tokens"] == 3 * 4 * 32 and result["windows"] == summary["val_windows"] == 12
    measured = "on 384 tokens: the first 12 windows of 32 tokens of the validation split"
    assert measured in trained and measured in evaluated
    assert f"validation loss {summary['val_loss']:.4f}" in trained and f"validation loss {result['val_loss']:.4f}" in evaluated


def _tiny_llama(path, act):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=320, hidden_size=32, intermediate_size=88, num_hidden_layers=1, num_attention_heads=2,
                      max_position_embeddings=64, hidden_act=act)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return str(path)


def test_eval_and_convert_say_when_the_activation_is_not_relu(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    corpus = small_corpus(data)
    opts = ["--data", corpus, "--val-fraction", "0.2", "--seq-len", "32", "--batch-size", "2", "--val-batches", "1", "--json"]
    silu = _tiny_llama(tmp_path / "silu", "silu")
    result = eval_main([silu, *opts])
    captured = capsys.readouterr()
    assert result["hidden_act"] == "silu" and result["evaluated_act"] == "relu"
    assert json.loads(captured.out)["hidden_act"] == "silu"  # the note does not break --json
    assert re.search(r"note: .*silu: its MLPs use silu, not ReLU; twell's sparse MLPs compute ReLU in its place.*"
                     "evaluated with ReLU, not as it was trained", captured.err)
    main(["eval", _tiny_llama(tmp_path / "relu", "relu"), *opts])
    assert "note" not in capsys.readouterr().err
    main(["convert", silu, str(tmp_path / "converted")])
    assert re.search(r"note: .*silu: its MLPs use silu, not ReLU.*saved with hidden_act relu", capsys.readouterr().err)


def test_arguments_are_checked_before_torch_loads():
    """--help and argument errors come before torch and transformers are imported (seconds)."""
    code = textwrap.dedent("""
        import sys
        from twell.cli import main
        for argv in (["--help"], ["train", "--help"], ["eval", "--help"], ["export", "--help"], ["convert", "--help"],
                     ["bench", "--help"], ["data", "--help"], ["train", "--steps", "0"],
                     ["train", "--keep", "-1"], ["train", "--resume", "/no/such/run"], ["eval", "/no/such/run"],
                     ["export", "/no/such/run", "/no/such/out"]):
            try:
                main(argv)
            except SystemExit as e:
                print(e, file=sys.stderr)
        print(sorted(m for m in ("torch", "transformers", "numpy") if m in sys.modules))
    """)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.stdout.strip().splitlines()[-1] == "[]", proc.stdout + proc.stderr
    assert "steps (--steps) must be >= 1, got 0" in proc.stderr and "keep (--keep) must be >= 0" in proc.stderr
    assert "no checkpoint in /no/such/run" in proc.stderr
    assert "twell export: no checkpoint in /no/such/run" in proc.stderr


def test_no_documents_names_the_file_types_read(tmp_path):
    (tmp_path / "table.csv").write_text("a,b\n1,2\n")
    with pytest.raises(SystemExit, match=r"found no documents; twell reads \.md \.py \.rst \.txt files .*\.jsonl .*\.parquet"):
        main(["train", *FAST, "--data", str(tmp_path), "--out", str(tmp_path / "run")])


def test_readme_gives_the_cpu_torch_command_and_ci_keeps_its_pin():
    """The README's CPU install uses PyTorch's CPU wheel index; .ci/run keeps the plain pin that
    the CI machine's pip configuration serves as the CPU build."""
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in (root / "README.md").read_text()
    assert 'python -m pip install -q "torch==2.13.0"' in (root / ".ci" / "run").read_text()
