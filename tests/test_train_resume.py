"""Checkpoints: --resume continues exactly; the export loads back in transformers and twell."""

import pytest
import torch
from transformers import LlamaForCausalLM

from test_train_loss import config
from twell import sparsify, sparse_modules
from twell.recipe.report import read_history
from twell.recipe.trainer import Trainer


def test_resume_continues_exactly(tmp_path):
    # Everything that carries state across steps is on: Adam moments, warm-up and cosine
    # schedule, L1 warm-up, gradient accumulation, dead-unit windows and Eq. 6 re-init.
    common = dict(steps=6, log_every=1, eval_every=3, save_every=3, grad_accum=2, warmup=2,
                  l1=0.05, l1_warmup=4, reinit=True, dead_window=2)
    full = Trainer(config(tmp_path, **common, out=str(tmp_path / "full")))
    full.fit()
    resumed = Trainer(config(tmp_path, **common, out=str(tmp_path / "resumed")),
                      resume=str(tmp_path / "full" / "checkpoints" / "step_000003"))
    assert resumed.step == 3 and resumed.samples_seen == 3 * 8
    resumed.fit()
    a = {r["step"]: r for r in read_history(tmp_path / "full" / "log.csv")}
    b = {r["step"]: r for r in read_history(tmp_path / "resumed" / "log.csv")}
    assert sorted(b) == [4, 5, 6]
    for step in (4, 5, 6):
        for key in ("ce", "l1", "loss", "lr", "lambda", "active_mean", "active_max", "dead_frac"):
            assert a[step][key] == b[step][key], (step, key)
    assert a[6]["val_loss"] == b[6]["val_loss"]
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        assert torch.equal(p, q), n


def test_resume_into_the_same_folder_keeps_one_log(tmp_path):
    common = dict(steps=4, log_every=1, eval_every=4, save_every=2)
    Trainer(config(tmp_path, **common)).fit()
    cfg = config(tmp_path, **{**common, "steps": 6})
    Trainer(cfg, resume=cfg.out).fit()  # the run folder: its newest checkpoint (step 4)
    assert [r["step"] for r in read_history(tmp_path / "run" / "log.csv")] == [1, 2, 3, 4, 5, 6]


def test_checkpoint_loads_in_transformers_and_twell(tmp_path):
    t = Trainer(config(tmp_path, steps=3, log_every=1, eval_every=3))
    summary = t.fit()
    path = summary["checkpoint"]
    x = torch.randint(0, 257, (2, 16))
    t.model.eval()
    with torch.no_grad():
        want = t.model(input_ids=x).logits
        plain = LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        assert plain.config.hidden_act == "relu" and not sparse_modules(plain)
        # generate() stops at the corpus's document separator (the byte tokenizer's 256)
        assert plain.config.eos_token_id == plain.generation_config.eos_token_id == 256
        torch.testing.assert_close(plain(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)
        sparse = sparsify(plain)
        assert len(sparse_modules(sparse)) == 2
        torch.testing.assert_close(sparse(input_ids=x).logits, want, rtol=1e-5, atol=1e-5)


def test_resume_past_the_end_is_a_clear_error(tmp_path):
    Trainer(config(tmp_path, steps=2, log_every=1, eval_every=2)).fit()
    with pytest.raises(ValueError, match="nothing to do"):
        Trainer(config(tmp_path, steps=2), resume=str(tmp_path / "run"))


def test_resume_between_log_steps_logs_what_an_uninterrupted_run_logs(tmp_path):
    """A checkpoint at step 3 with log rows every 2 steps: the step-4 row averages steps 3 and
    4, so the sums since the last log row (losses, statistics) must travel in the checkpoint."""
    common = dict(steps=4, log_every=2, save_every=3, l1=0.05, dead_window=4)
    Trainer(config(tmp_path, **common, out=str(tmp_path / "full"))).fit()
    resumed = Trainer(config(tmp_path, **common, out=str(tmp_path / "resumed")),
                      resume=str(tmp_path / "full" / "checkpoints" / "step_000003"))
    assert resumed.step == 3 and resumed.n_acc == 1 and resumed.interval.tokens == 4 * 32
    resumed.fit()
    a = read_history(tmp_path / "full" / "log.csv")[-1]
    b = read_history(tmp_path / "resumed" / "log.csv")
    assert [r["step"] for r in b] == [4] and a["step"] == 4
    for key in a:
        if key != "tokens_per_s":
            assert a[key] == b[0][key], key


def test_resume_with_other_batch_settings_restores_the_data_position(tmp_path):
    """The checkpoint's data position is restored, not recomputed from step x batch: after 2
    steps of 4 sequences, a run resumed with 2 micro-batches of 3 (6 a step) starts at sample 8
    (step x new batch would say 12) and then reads samples 8-13."""
    Trainer(config(tmp_path, steps=2, log_every=1, eval_every=2, batch_size=4)).fit()
    cfg = config(tmp_path, steps=3, log_every=1, eval_every=3, batch_size=3, grad_accum=2)
    resumed = Trainer(cfg, resume=cfg.out)
    assert resumed.step == 2 and resumed.global_batch == 6 and resumed.samples_seen == 8
    data = resumed.train_data
    assert torch.equal(resumed.micro_batch(0), data.batch(8, 3)) and torch.equal(resumed.micro_batch(1), data.batch(11, 3))
    resumed.fit()
    assert resumed.samples_seen == 14 and read_history(tmp_path / "run" / "log.csv")[-1]["tokens"] == 14 * 32


@pytest.mark.gpu
@pytest.mark.parametrize("kernels", ["sparse", "dense"])
def test_gpu_resume_in_the_kernel_layout(tmp_path, kernels):
    """On CUDA the sparse modules train with down_proj.weight in the kernel layout (the transpose
    of a contiguous [f, d] matrix) under fused AdamW, whose state must have the parameter's
    strides; a resumed run loads a checkpoint's state and continues with the losses of the
    uninterrupted run (within the run-to-run spread of the GPU's atomics)."""
    common = dict(steps=6, log_every=1, save_every=3, warmup=2, l1=0.05, device="cuda", kernels=kernels)
    full = Trainer(config(tmp_path, **common, out=str(tmp_path / "full")))
    for m in sparse_modules(full.model):
        w = m.down_proj.weight
        assert w.is_cuda and w.t().is_contiguous() and not w.is_contiguous()
    full.fit()
    resumed = Trainer(config(tmp_path, **common, out=str(tmp_path / "resumed")),
                      resume=str(tmp_path / "full" / "checkpoints" / "step_000003"))
    resumed.fit()
    for m in sparse_modules(resumed.model):
        w = m.down_proj.weight
        assert w.t().is_contiguous()
        assert all(v.stride() == w.stride() for v in resumed.optimizer.state[w].values() if v.dim() == 2)
    a = {r["step"]: r for r in read_history(tmp_path / "full" / "log.csv")}
    b = {r["step"]: r for r in read_history(tmp_path / "resumed" / "log.csv")}
    for step in (4, 5, 6):
        assert abs(a[step]["loss"] - b[step]["loss"]) <= 1e-3 * abs(a[step]["loss"]), step
    for (n, p), q in zip(full.model.named_parameters(), resumed.model.parameters()):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3, msg=n)
