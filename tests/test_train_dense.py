"""twell train --activation silu: a dense baseline (the preset with Hugging Face's own SiLU MLPs,
cross entropy alone), its log and summary without sparsity, its checkpoints, export, eval and
resume, and the export as the start of a sparse run (--init-from)."""

import json

import pytest
import torch
import torch.nn.functional as F
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.models.llama.modeling_llama import LlamaMLP

from test_train_cli import FAST
from test_train_loss import config, small_corpus
from twell import sparse_modules
from twell.cli import main
from twell.recipe.report import read_history
from twell.recipe.trainer import Trainer


def test_a_silu_run_trains_hugging_faces_mlps_on_cross_entropy_alone(tmp_path):
    t = Trainer(config(tmp_path, activation="silu", steps=4, log_every=2))
    assert t.cfg.l1 == 0.0 and t.dense and not sparse_modules(t.model) and not t.modules
    assert t.config.hidden_act == "silu"
    assert all(type(layer.mlp) is LlamaMLP for layer in t.model.model.layers)
    # the step's loss is the plain model's cross entropy on its batch, and its gradient that of CE alone
    batch = t.micro_batch(0)
    logits = t.model(input_ids=batch[:, :-1], use_cache=False).logits
    ce = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    ce.backward()
    want = {n: p.grad.clone() for n, p in t.model.named_parameters()}
    t.optimizer.zero_grad(set_to_none=True)
    got_ce, got_l1 = t.forward_backward()
    torch.testing.assert_close(got_ce, ce.detach())
    assert float(got_l1) == 0.0
    for n, p in t.model.named_parameters():
        torch.testing.assert_close(p.grad, want[n], msg=n)
    t.optimizer.zero_grad(set_to_none=True)


def test_a_silu_run_logs_summarises_exports_and_evaluates_without_sparsity(tmp_path, capsys):
    data = tmp_path / "data"
    data.mkdir()
    out, hf = tmp_path / "run", tmp_path / "hf"
    main(["train", *[a for a in FAST if a != "--no-plot"], "--activation", "silu", "--data", small_corpus(data),
          "--val-fraction", "0.2", "--steps", "4", "--log-every", "2", "--out", str(out)])
    printed = capsys.readouterr().out
    assert "dense silu" in printed and "== summary" in printed and "active units" not in printed
    rows = read_history(out / "log.csv")
    assert [r["step"] for r in rows] == [2, 4] and "val_loss" in rows[-1]
    assert not any(k.startswith(("active", "dead")) for r in rows for k in r)
    assert all(r["lambda"] == 0 and r["l1"] == 0 for r in rows)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["activation"] == "silu" and summary["lambda"] == 0
    assert summary["active_per_token_by_layer"] is None and summary["dead_frac_val_by_layer"] is None
    assert (out / "training.png").is_file()
    step = out / "checkpoints" / "step_000004"
    assert json.loads((step / "config.json").read_text())["hidden_act"] == "silu"

    main(["export", str(out), str(hf)])
    capsys.readouterr()
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32).eval()
    assert type(model).__name__ == "LlamaForCausalLM" and model.config.hidden_act == "silu"
    assert all(type(layer.mlp) is LlamaMLP for layer in model.model.layers)
    tok = AutoTokenizer.from_pretrained(hf)
    assert tok("ab")["input_ids"] == [97, 98] and tok.eos_token_id == 256
    trained = AutoModelForCausalLM.from_pretrained(step, dtype=torch.float32).eval()
    x = torch.randint(0, 257, (2, 16))
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=x).logits, trained(input_ids=x).logits)

    main(["eval", str(hf), "--json"])
    captured = capsys.readouterr()
    result = json.loads(captured.out)
    assert "evaluated with ReLU" not in captured.err
    assert result["evaluated_act"] == "silu" and "active_per_token" not in result
    assert result["val_loss"] == pytest.approx(summary["val_loss"], rel=1e-5)


def test_the_export_of_a_silu_run_starts_a_sparse_run(tmp_path):
    Trainer(config(tmp_path, activation="silu", steps=2, log_every=1)).fit()
    main(["export", str(tmp_path / "run"), str(tmp_path / "hf")])
    t = Trainer(config(tmp_path, preset="tiny", hidden_size=None, intermediate_size=None, num_layers=None,
                       num_heads=None, init_from=str(tmp_path / "hf"), out=str(tmp_path / "sparse"), steps=2,
                       log_every=1, l1_target=0.1))
    assert t.converted_from == "silu" and t.config.hidden_act == "relu" and len(t.modules) == 2
    summary = t.fit()
    assert len(summary["active_per_token_by_layer"]) == 2 and summary["l1_warmup"] == 0  # (a quarter of 2 steps)


def test_a_silu_run_resumes_exactly(tmp_path):
    common = dict(activation="silu", steps=4, log_every=1, eval_every=2, save_every=2, warmup=2)
    Trainer(config(tmp_path, **common, out=str(tmp_path / "full"))).fit()
    resumed = Trainer(config(tmp_path, **common, out=str(tmp_path / "resumed")),
                      resume=str(tmp_path / "full" / "checkpoints" / "step_000002"))
    resumed.fit()
    a = {r["step"]: r for r in read_history(tmp_path / "full" / "log.csv")}
    b = {r["step"]: r for r in read_history(tmp_path / "resumed" / "log.csv")}
    for s in (3, 4):
        assert a[s]["ce"] == b[s]["ce"]
    assert a[4]["val_loss"] == b[4]["val_loss"]


def test_a_checkpoint_resumes_only_with_its_own_activation(tmp_path):
    Trainer(config(tmp_path, steps=2, log_every=1)).fit()  # ReLU
    with pytest.raises(ValueError, match=r"its MLPs use relu, the run's settings say --activation silu"):
        Trainer(config(tmp_path, activation="silu", steps=4), resume=str(tmp_path / "run"))


@pytest.mark.parametrize("argv, message", [
    (["--l1", "1e-5"], r"--activation silu trains a dense baseline with lambda 0: leave --l1 out"),
    (["--l1-target", "0.01"], r"leave --l1-target out"),
    (["--l1-warmup", "10"], r"leave --l1-warmup out"),
    (["--reinit"], r"leave --reinit out"),
    (["--init-from", "somewhere"], r"--activation silu and --init-from: a run from a folder converts"),
    (["--activation", "gelu"], None),
])
def test_options_a_dense_run_cannot_take_are_clear_errors(tmp_path, argv, message, capsys):
    with pytest.raises(SystemExit, match=message):
        main(["train", *FAST, "--activation", "silu", "--out", str(tmp_path), *argv])
    if message is None:
        assert "invalid choice: 'gelu'" in capsys.readouterr().err
