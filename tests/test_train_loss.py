"""twell train's loss (CE + lambda * L1), its statistics and dead-unit re-initialisation."""

import types
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from twell import SparseGatedMLP, sparse_modules
from twell.recipe.stats import DeadUnits, IntervalStats
from twell.recipe.trainer import TrainConfig, Trainer

SHAPE = dict(preset="tiny", hidden_size=32, intermediate_size=88, num_layers=2, num_heads=2, seq_len=32,
             batch_size=4, val_batches=1, progress=False, plot=False)


def small_corpus(path: Path) -> str:
    """A few real text files (sources of stdlib modules) in ``path``; returns it as a --data spec."""
    import inspect
    import json as json_mod

    for mod in (json_mod, inspect, types):
        src = Path(mod.__file__).read_text()
        (path / f"{mod.__name__}.txt").write_text(src)
    for i in range(30):
        (path / f"doc{i}.txt").write_text(f"def f{i}(x):\n    return x * {i} + {i * i}\n" * 20)
    return str(path)


def config(tmp_path, **kw) -> TrainConfig:
    data = tmp_path / "data"
    data.mkdir(exist_ok=True)
    return TrainConfig(**{**SHAPE, "data": [small_corpus(data)], "out": str(tmp_path / "run"), "val_fraction": 0.2, **kw})


def test_loss_gradient_is_ce_plus_lambda_times_mean_layer_l1(tmp_path):
    """The trainer's gradients equal those of the loss written out by hand, with L1 = mean over
    layers of (mean over tokens of the SUM over hidden units of |relu(gate x) * up x|)."""
    lam = 0.05  # large, so that a wrong L1 term would show in the gradients
    t = Trainer(config(tmp_path, l1=lam, batch_size=2))
    reference = Trainer(config(tmp_path, l1=lam, batch_size=2))
    ce, l1 = t.forward_backward()
    got = {n: p.grad.clone() for n, p in t.model.named_parameters()}

    hs = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: hs.append(
        torch.relu(mod.gate_proj(inp[0])) * mod.up_proj(inp[0]))) for m in sparse_modules(reference.model)]
    batch = reference.micro_batch(0)
    logits = reference.model(input_ids=batch[:, :-1]).logits
    ce_ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    l1_ref = torch.stack([h.abs().sum(-1).mean() for h in hs]).mean()
    (ce_ref + lam * l1_ref).backward()
    for h in hooks:
        h.remove()
    assert len(hs) == 2
    torch.testing.assert_close(ce, ce_ref.detach())
    torch.testing.assert_close(l1, l1_ref.detach())
    for n, p in reference.model.named_parameters():
        torch.testing.assert_close(got[n], p.grad, rtol=1e-5, atol=1e-7, msg=n)
    # the L1 part really contributes: without it the gate gradients differ
    t.optimizer.zero_grad()
    t.cfg.l1 = 0.0
    t.forward_backward()
    g0 = t.model.model.layers[0].mlp.gate_proj.weight.grad
    assert (g0 - got["model.layers.0.mlp.gate_proj.weight"]).norm() > 1e-3 * g0.norm()


def test_l1_warmup_is_linear(tmp_path):
    t = Trainer(config(tmp_path, l1=2e-5, l1_warmup=10))
    assert [t.l1_coef(s) for s in (1, 5, 10, 20)] == pytest.approx([2e-6, 1e-5, 2e-5, 2e-5])
    t.cfg.l1_warmup = 0
    assert t.l1_coef(1) == 2e-5


def test_l1_target_weights_each_layer_and_adapts_toward_the_target(tmp_path):
    """With --l1-target, the L1 term is the mean over layers of each layer's multiplier times its
    l1 (gradients equal the hand-written loss), and a log row moves each multiplier by
    sqrt(active share / target) within [0.8, 1.25]; the multipliers survive a checkpoint."""
    lam = 0.05
    t = Trainer(config(tmp_path, l1=lam, batch_size=2, l1_target=0.1))
    f = t.config.intermediate_size
    row = {"active_mean_L0": 0.1 * f * 1.21, "active_mean_L1": 0.1 * f * 0.01}
    t.adapt_l1(row)
    assert t.l1_scale == pytest.approx([1.1, 0.8])
    t.adapt_l1({"active_mean_L0": 100.0 * f, "active_mean_L1": 0.1 * f})
    assert t.l1_scale == pytest.approx([1.1 * 1.25, 0.8])
    t.forward_backward()
    got = t.model.model.layers[0].mlp.gate_proj.weight.grad.clone()

    ref = Trainer(config(tmp_path, l1=lam, batch_size=2))
    hs = []
    hooks = [m.register_forward_hook(lambda mod, inp, out: hs.append(
        torch.relu(mod.gate_proj(inp[0])) * mod.up_proj(inp[0]))) for m in sparse_modules(ref.model)]
    batch = ref.micro_batch(0)
    logits = ref.model(input_ids=batch[:, :-1]).logits
    ce_ref = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
    scales = torch.tensor([1.1 * 1.25, 0.8])
    l1_ref = (torch.stack([h.abs().sum(-1).mean() for h in hs]) * scales).mean()
    (ce_ref + lam * l1_ref).backward()
    for h in hooks:
        h.remove()
    torch.testing.assert_close(got, ref.model.model.layers[0].mlp.gate_proj.weight.grad, rtol=1e-5, atol=1e-7)

    t.train_step()
    path = t.save_checkpoint(blocking=True)
    resumed = Trainer(config(tmp_path, l1=lam, batch_size=2, l1_target=0.1), resume=str(path))
    assert resumed.l1_scale == pytest.approx(t.l1_scale)
    # bounded, and still while lambda ramps up (sparsity cannot answer yet: the multiplier would run away)
    for _ in range(200):
        resumed.adapt_l1({"active_mean_L0": float(f), "active_mean_L1": 0.0})
    assert resumed.l1_scale == pytest.approx([1e6, 1e-6])
    ramping = Trainer(config(tmp_path, l1=lam, l1_target=0.1, l1_warmup=50))
    ramping.adapt_l1({"active_mean_L0": float(f), "active_mean_L1": 0.0})
    assert ramping.l1_scale == [1.0, 1.0]
    with pytest.raises(ValueError, match="l1-target"):
        Trainer(config(tmp_path, l1=0.0, l1_target=0.1))
    with pytest.raises(ValueError, match="L1 target"):
        Trainer(config(tmp_path, l1=lam, l1_target=1.5))


def test_interval_stats_match_direct_computation():
    torch.manual_seed(0)
    mlps = [SparseGatedMLP(16, 40), SparseGatedMLP(16, 40)]
    stats = IntervalStats(2, "cpu")
    xs = [torch.randn(7, 16), torch.randn(13, 16)]  # micro-batches of different sizes
    actives = [[], []]
    for x in xs:
        for i, m in enumerate(mlps):
            m.train()
            m(x).sum()
            actives[i].append((torch.relu(m.gate_proj(x)) > 0).sum(1))
        stats.observe(mlps)
    out = stats.reduce()
    assert out["tokens"] == 20
    for i in range(2):
        per_token = torch.cat(actives[i]).double()
        assert out["active_mean"][i] == pytest.approx(per_token.mean().item())
        assert out["active_max"][i] == per_token.max().item()
    assert stats.tokens == 0  # reset after reduce


def _fake(counts):
    return types.SimpleNamespace(stats=types.SimpleNamespace(unit_counts=torch.tensor(counts)))


def test_dead_units_over_a_window():
    dead = DeadUnits(1, 4, window_steps=2, device="cpu")
    dead.observe([_fake([1, 0, 0, 3])])
    dead.end_step([], 1)
    assert dead.dead_frac is None  # no window completed yet
    dead.observe([_fake([0, 0, 2, 0])])
    dead.end_step([], 2)
    assert dead.dead_frac == [0.25] and dead.dead.tolist() == [[False, True, False, False]]
    dead.observe([_fake([5, 5, 5, 5])])
    dead.end_step([], 3)
    assert dead.dead_frac == [0.25]  # the last completed window is reported until the next one ends


def test_reinit_applies_eq6_to_dead_units_only():
    torch.manual_seed(0)
    m = SparseGatedMLP(8, 6)
    m.train()
    with torch.no_grad():
        m.gate_proj.weight[:3] = -m.gate_proj.weight[:3].abs()  # units 0..2 never fire on x > 0
        m.gate_proj.weight[3:] = m.gate_proj.weight[3:].abs()
    x = torch.rand(20, 8) + 0.1
    dead = DeadUnits(1, 6, window_steps=1, device="cpu", reinit=True, keep=0.9, std=0.02, seed=5)
    m(x)
    dead.observe([m])
    before = m.gate_proj.weight.detach().clone()
    dead.end_step([m], step=1)
    assert dead.dead[0].tolist() == [True] * 3 + [False] * 3
    gen = torch.Generator().manual_seed(5 * 1_000_003 + 1)
    noise = torch.randn(before.shape, generator=gen) * 0.02
    w = m.gate_proj.weight.detach()
    torch.testing.assert_close(w[:3], 0.9 * before[:3] + 0.1 * noise[:3])
    assert torch.equal(w[3:], before[3:])
    assert int(dead.reinit_count) == 3
    # a unit that fires again within the window is no longer nudged
    with torch.no_grad():
        m.gate_proj.weight[0] = 1.0
    m(x)
    dead.window_steps = 10  # keep the verdict of the last window
    dead.observe([m])
    before = m.gate_proj.weight.detach().clone()
    dead.end_step([m], step=2)
    assert torch.equal(m.gate_proj.weight[0], before[0])
    assert not torch.equal(m.gate_proj.weight[1], before[1])


def test_reinit_runs_in_training(tmp_path):
    """Units whose gate rows are zero never fire and get no gradient (relu'(0) = 0): dead for
    good without --reinit; with it, Eq. 6 moves their rows off zero after the first window."""
    common = dict(steps=6, dead_window=2, log_every=2, eval_every=6)
    runs = {}
    for reinit in (False, True):
        t = Trainer(config(tmp_path, **common, reinit=reinit, out=str(tmp_path / f"reinit_{reinit}")))
        with torch.no_grad():
            for m in t.modules:
                m.gate_proj.weight[:10] = 0.0
        t.fit()
        runs[reinit] = t
    off, on = runs[False], runs[True]
    for m in off.modules:
        assert torch.count_nonzero(m.gate_proj.weight[:10]) == 0
    assert all(d >= 10 / 88 for d in off.dead.dead_frac) and int(off.dead.reinit_count) == 0
    for m in on.modules:
        assert bool((m.gate_proj.weight[:10].abs().sum(dim=1) > 0).all())
    assert int(on.dead.reinit_count) >= 2 * 10


def test_bad_config_values_are_clear_errors(tmp_path):
    for kw, msg in [(dict(steps=0), "steps"), (dict(l1=-1.0), "L1"), (dict(preset="huge"), "unknown preset"),
                    (dict(precision="bf16", device="cpu"), "bf16"), (dict(hidden_size=30, num_heads=4), "multiple")]:
        with pytest.raises(ValueError, match=msg):
            Trainer(config(tmp_path, **kw))


def test_gradient_accumulation_gives_the_gradients_of_one_batch(tmp_path):
    """2 micro-batches of 2 sequences give the gradients of 1 batch of the same 4 sequences,
    compared directly (before clipping, which would hide a scale), and the same pre-clip norm."""
    lam = 0.05
    one = Trainer(config(tmp_path, l1=lam, batch_size=4, grad_accum=1))
    two = Trainer(config(tmp_path, l1=lam, batch_size=2, grad_accum=2))
    assert torch.equal(torch.cat([two.micro_batch(0), two.micro_batch(1)]), one.micro_batch(0))
    ce1, l1_1 = one.forward_backward()
    ce2, l1_2 = two.forward_backward()
    torch.testing.assert_close(ce2, ce1)
    torch.testing.assert_close(l1_2, l1_1)
    grads = {n: p.grad for n, p in one.model.named_parameters()}
    for n, p in two.model.named_parameters():
        torch.testing.assert_close(p.grad, grads[n], rtol=1e-4, atol=1e-7, msg=n)
    # through a whole step, clipping on: the logged (pre-clip) norms agree as well
    for t in (one, two):
        t.optimizer.zero_grad(set_to_none=True)
        t.interval.reset()
    r1, r2 = one.train_step(), two.train_step()
    assert r1.applied and r2.applied and float(r1.grad_norm) > one.cfg.grad_clip  # clipping was active
    torch.testing.assert_close(r2.grad_norm, r1.grad_norm, rtol=1e-4, atol=0)
