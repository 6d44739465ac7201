"""Dead units under an L1 target: each layer's dead share recorded in the log, the summary and
the plot, and the dead-unit limit, which holds the lambda of a layer whose share exceeds it."""

import math

import pytest
import torch

from test_train_loss import config
from twell.recipe.report import draw_history, format_summary, read_history
from twell.recipe.trainer import Trainer

HIGH = {"active_mean_L0": 50.0, "active_mean_L1": 50.0}  # far above a target of 0.1% of 88 units


def test_a_layer_over_the_dead_limit_is_held_and_the_others_are_not(tmp_path):
    t = Trainer(config(tmp_path, l1_target=0.001, dead_limit=0.1))
    t.adapt_l1({**HIGH, "dead_frac_L0": 0.5, "dead_frac_L1": 0.05})
    assert t.l1_scale == pytest.approx([1.0, 1.25]) and t.dead_holds == [1, 0]
    t.adapt_l1({**HIGH, "dead_frac_L0": 0.05, "dead_frac_L1": 0.05})  # back under the limit: rises again
    assert t.l1_scale == pytest.approx([1.25, 1.5625]) and t.dead_holds == [1, 0]
    t.adapt_l1({"active_mean_L0": 0.0, "active_mean_L1": 50.0, "dead_frac_L0": 1.0, "dead_frac_L1": math.nan})
    assert t.l1_scale == pytest.approx([1.0, 1.953125]) and t.dead_holds == [2, 0]  # below the target: it still falls
    off = Trainer(config(tmp_path, l1_target=0.001, dead_limit=None))
    off.adapt_l1({**HIGH, "dead_frac_L0": 0.5, "dead_frac_L1": 0.05})
    assert off.l1_scale == pytest.approx([1.25, 1.25]) and off.dead_holds == [0, 0]


def test_a_held_layer_does_not_follow_the_ramp(tmp_path):
    """During --l1-warmup lambda rises with the ramp; a held layer's multiplier shrinks by what
    the ramp adds before the next log row, so its lambda stays where it is."""
    t = Trainer(config(tmp_path, l1=0.01, l1_target=0.001, l1_warmup=10, log_every=2))
    t.step = 4
    t.adapt_l1({**HIGH, "dead_frac_L0": 0.5, "dead_frac_L1": 0.0})
    assert t.l1_scale == pytest.approx([4 / 6, 1.0])
    assert t.l1_coef(6) * t.l1_scale[0] == pytest.approx(t.l1_coef(4))


@pytest.mark.parametrize("limit", [0.3, None])
def test_a_layer_forced_half_dead_keeps_its_lambda(tmp_path, limit):
    """Half of layer 0's gate rows set to zero: those units never fire (no gradient reaches
    them) and the layer's dead share is one half. Under the limit its lambda stays put while
    layer 1's rises toward the target; without the limit both rise. The log, the summary and
    its printed form carry each layer's dead shares. (Re-initialisation off: it would revive them.)"""
    t = Trainer(config(tmp_path, steps=8, log_every=2, eval_every=4, dead_window=2, l1_target=0.001, dead_limit=limit,
                       reinit=False))
    with torch.no_grad():
        t.model.model.layers[0].mlp.gate_proj.weight[::2] = 0.0
    summary = t.fit()
    rows = read_history(tmp_path / "run" / "log.csv")
    assert [r["step"] for r in rows] == [2, 4, 6, 8]
    assert all(r["dead_frac_L0"] == pytest.approx(0.5) and r["dead_frac_L1"] <= 0.1 for r in rows)
    evaluated = [r for r in rows if "val_loss" in r]
    assert [r["step"] for r in evaluated] == [4, 8] and all(r["dead_frac_val_L0"] >= 0.5 for r in evaluated)
    assert all(r["dead_frac_val"] == pytest.approx((r["dead_frac_val_L0"] + r["dead_frac_val_L1"]) / 2) for r in evaluated)
    lam0, lam1 = [r["lambda_L0"] for r in rows], [r["lambda_L1"] for r in rows]
    assert lam1 == pytest.approx([2e-5 * 1.25 ** k for k in range(4)])
    if limit is None:
        assert lam0 == pytest.approx(lam1) and summary["dead_holds_by_layer"] == [0, 0]
    else:
        assert lam0 == pytest.approx([2e-5] * 4) and summary["dead_holds_by_layer"] == [4, 0]
        assert "lambda held (dead share over 30%), log rows per layer: 4 0" in format_summary(summary)
    assert summary["dead_limit"] == limit
    assert summary["dead_frac_window_by_layer"][0] == pytest.approx(0.5)
    assert summary["dead_frac_window_max_by_layer"][0] == pytest.approx(0.5)
    assert summary["dead_frac_val_by_layer"][0] >= 0.5


def test_dead_units_come_back_by_default(tmp_path):
    """The same half-dead layer with the recipe's defaults: re-initialisation (Eq. 6) is on for
    ReLU runs, so the zeroed gate rows are nudged after the first window and fire again; the
    layer's dead share falls from one half, and the summary counts the nudges."""
    t = Trainer(config(tmp_path, steps=8, log_every=2, eval_every=4, dead_window=2, l1_target=0.001))
    assert t.cfg.reinit is True
    with torch.no_grad():
        t.model.model.layers[0].mlp.gate_proj.weight[::2] = 0.0
    summary = t.fit()
    rows = read_history(tmp_path / "run" / "log.csv")
    assert rows[0]["dead_frac_L0"] == pytest.approx(0.5)  # the first window: dead as made
    assert rows[-1]["dead_frac_L0"] < 0.1 and summary["dead_frac_val_by_layer"][0] < 0.1
    assert summary["reinit"] is True and summary["reinit_unit_steps"] > 0


def test_no_limit_without_a_target(tmp_path):
    summary = Trainer(config(tmp_path, steps=2, log_every=1)).fit()
    assert summary["dead_limit"] is None and summary["dead_holds_by_layer"] is None


def test_the_plot_draws_each_layers_dead_share(tmp_path):
    history = [{"step": s, "ce": 3.0, "active_mean": 5.0, "dead_frac": d, **{f"active_mean_L{i}": 5.0 for i in range(3)},
                **{f"dead_frac_L{i}": d * i for i in range(3)}} for s, d in ((1, math.nan), (2, 0.1), (3, 0.2))]
    history[-1].update({"val_loss": 2.5, **{f"dead_frac_val_L{i}": 0.1 for i in range(3)}})
    fig = draw_history(history, 88, dead_limit=0.1)
    dead = fig.axes[2]
    labels = [line.get_label() for line in dead.get_lines()]
    assert [k for k in labels if k.startswith("layer")] == ["layer 0", "layer 1", "layer 2"]
    assert "mean over layers" in labels and "limit (lambda held above)" in labels
    layer2 = dead.get_lines()[labels.index("layer 2")].get_ydata()
    assert math.isnan(layer2[0]) and list(layer2[1:]) == pytest.approx([20.0, 40.0])
    assert sum(1 for line in dead.get_lines() if line.get_marker() == "o") == 3  # the validation dots
