"""The whole-model benchmark's pieces that run on a CPU: the sparsity construction and greedy
decoding with a static cache (its CUDA-graph timing runs on the GPU only)."""

import pytest
import torch

pytest.importorskip("transformers")
from transformers import LlamaForCausalLM  # noqa: E402

from twell import sparsify  # noqa: E402
from twell.bench.model import active_units, calibrate_sparsity, greedy_decode  # noqa: E402
from twell.recipe.model import make_config  # noqa: E402


def _model(layers=3, seed=0):
    torch.manual_seed(seed)
    config = make_config("tiny", 300)
    config.hidden_act = "relu"
    config.num_hidden_layers = layers
    return LlamaForCausalLM(config).eval()


def test_calibration_gives_every_layer_about_k_active_units_without_a_heavy_tail():
    model = _model()
    f = model.config.intermediate_size
    k = 12
    cal = calibrate_sparsity(model, k, torch.randint(0, 300, (4, 128)))
    assert len(cal["active_mean"]) == 3
    fresh = active_units(model, torch.randint(0, 300, (4, 128)))
    for mean, top in zip(fresh["active_mean"], fresh["active_max"]):
        assert 0.7 * k <= mean <= 1.4 * k  # fresh tokens, not the calibration ones
        assert top <= 5 * k < f
    # channel 0 of the residual stream is never written: it is the gate's bias input
    base = model.model
    for layer in base.layers:
        assert torch.all(layer.self_attn.o_proj.weight[0] == 0) and torch.all(layer.mlp.down_proj.weight[0] == 0)
    assert torch.all(base.embed_tokens.weight[:, 0] == cal["scale"])


def test_calibration_works_on_a_sparsified_model_and_keeps_its_function():
    dense, sparse = _model(seed=1), sparsify(_model(seed=1)).eval()
    ids = torch.randint(0, 300, (2, 64))
    for m in (dense, sparse):
        calibrate_sparsity(m, 10, ids)
    with torch.no_grad():
        a, b = dense.model(input_ids=ids).last_hidden_state, sparse.model(input_ids=ids).last_hidden_state
    assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)


def test_greedy_decode_equals_generate():
    model = _model(layers=2, seed=2)
    calibrate_sparsity(model, 10, torch.randint(0, 300, (2, 64)))
    prompt = torch.randint(0, 300, (2, 9))
    out = greedy_decode(model, prompt, 7, graph=False)
    ref = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=7, do_sample=False)
    assert torch.equal(out["tokens"], ref)
    assert out["first_logits"].shape == (2, model.config.vocab_size) and out["timed_steps"] == 1  # 6 steps: eager, 5 untimed
    # (until twell's layers have captured and replayed their graphs: twell.inference.eager_graphs.CAPTURE_AFTER + 2)
    sparse = sparsify(model).eval()
    grad = []  # decoding runs without gradients, as generate does: twell's modules take their inference path
    sparse.register_forward_pre_hook(lambda *_: grad.append(torch.is_grad_enabled()))
    assert torch.equal(greedy_decode(sparse, prompt, 7, graph=False)["tokens"], ref)
    assert len(grad) == 7 and not any(grad)


def test_bench_model_reads_a_trained_run(tmp_path):
    """``twell bench model --model RUN``: the run's newest checkpoint, and its validation split as
    the benchmark's token stream (the windows ``twell eval`` reads)."""
    from test_train_loss import config

    from twell.bench.cli import _trained_model
    from twell.recipe.corpus import load_corpus
    from twell.recipe.data import load_tokenizer
    from twell.recipe.trainer import Trainer

    cfg = config(tmp_path, steps=2, log_every=1)
    Trainer(cfg).fit()
    path, tokens, preset = _trained_model(str(tmp_path / "run"))
    assert path.endswith("step_000002") and preset == "tiny"
    _, val = load_corpus(cfg.data, load_tokenizer("bytes"), cfg.seq_len, cfg.seed, cfg.val_fraction)
    assert tokens.dtype == torch.int64 and torch.equal(tokens, torch.as_tensor(val.tokens.astype("int64")))
    with pytest.raises(SystemExit, match="no config.json"):
        _trained_model(str(tmp_path / "nothing"))


def test_model_results_merge_keeps_other_models(tmp_path):
    """A run replaces the records of its own (preset, sparsity source) only; files of the first
    version (one "sparsity" entry) keep their construction under the model's key."""
    import json

    from twell.bench.cli import merge_model_results

    def run(preset, source, value):
        rec = lambda v: dict(preset=preset, sparsity_source=source, variant=v, prefill_ms=value)  # noqa: E731
        return {"records": [rec("dense"), rec("twell")], "decode": [dict(preset=preset, sparsity_source=source, batch=1)],
                "sparsity": {"source": source, "value": value}}

    path = tmp_path / "model_h200.json"
    first = run("2b", "calibrated", 1.0)
    path.write_text(json.dumps({"records": first["records"], "trained": {"val_loss": 0.7}, "decode": first["decode"],
                                "sparsity": {"k": 29}}))
    merged = merge_model_results(str(path), run("0.5b", "trained", 2.0), "0.5b")
    assert merged["sparsity_by_model"] == {"2b calibrated": {"k": 29}, "0.5b trained": {"source": "trained", "value": 2.0}}
    assert merged["trained"] == {"val_loss": 0.7} and len(merged["records"]) == 4 and len(merged["decode"]) == 2
    path.write_text(json.dumps(merged))
    again = merge_model_results(str(path), run("0.5b", "calibrated", 3.0), "0.5b")
    assert sorted((r["preset"], r["sparsity_source"], r["prefill_ms"]) for r in again["records"]) == sorted(
        [("2b", "calibrated", 1.0)] * 2 + [("0.5b", "trained", 2.0)] * 2 + [("0.5b", "calibrated", 3.0)] * 2)
    path.write_text(json.dumps(again))
    redo = merge_model_results(str(path), run("2b", "calibrated", 4.0), "2b")
    assert sorted(r["prefill_ms"] for r in redo["records"]) == [2.0, 2.0, 3.0, 3.0, 4.0, 4.0]
    assert set(redo["sparsity_by_model"]) == {"2b calibrated", "0.5b trained", "0.5b calibrated"}


def test_published_reference_figures_join_the_matching_records():
    """The published kernels' figures (constants from a side-by-side run) go only to
    the records of the same M, distribution, asked k and shape, and the table shows them."""
    from twell.bench.cli import _table
    from twell.bench.inference import PUBLISHED_H200, add_published

    base = dict(d=2048, f=5632, dense_ms=1.0, twell_ms=0.5, speedup=2.0, rel_err=1e-3, max_row_err=1e-3, dense_max_row_err=1e-3)
    recs = [dict(base, M=131072, distribution="heavy", k=29), dict(base, M=131072, distribution="heavy", k=56),
            dict(base, M=4096, distribution="even", k=29, d=4096, f=11008), dict(base, M=4096, distribution="even", k=29)]
    add_published(recs)
    dense_ms, ms, note = PUBLISHED_H200[(131072, "heavy", 29)]
    assert recs[0]["published_ms"] == ms and recs[0]["published_speedup"] == pytest.approx(dense_ms / ms)
    assert "wrong" in recs[0]["published_note"]
    assert "published_ms" not in recs[1] and "published_ms" not in recs[2]
    assert recs[3]["published_speedup"] == pytest.approx(0.43 / 0.30)
    lines = _table(recs).splitlines()
    assert lines[0].endswith("pub x") and lines[4].endswith(f"{0.43 / 0.30:6.2f}") and lines[2].endswith(" " * 6)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU fallback (wall time)")
def test_interleaved_timing_alternates_call_by_call():
    """interleaved_ms calls its callables in turn, one call each per step, and returns each one's
    median: a drift of the host between steps reaches both sides alike."""
    import time

    from twell.bench.timing import interleaved_ms

    order = []

    def work(tag, seconds):
        def fn():
            order.append(tag)
            time.sleep(seconds)
        return fn

    a, b = interleaved_ms([work("a", 0.001), work("b", 0.003)], calls=15, warmup=2)
    assert order == ["a", "b"] * 17
    assert 0.9 < a < 2.5 and b / a > 1.8


def test_chain_graph_ms_times_all_layers_per_replay_and_divides(monkeypatch):
    """chain_graph_ms captures every callable in turn in one graph, replays the whole chain, and
    reports the median replay time per callable (CUDA pieces replaced by stand-ins: the CPU has
    no graphs or events)."""
    import twell.bench.timing as timing

    order = []
    captured = []

    class FakeGraph:
        def __init__(self, fn):
            self.fn = fn

        def replay(self):
            order.append("replay")
            self.fn()

    def fake_capture(fn, warmup=3):
        captured.append(fn)
        return FakeGraph(fn)

    times = iter([8.0, 4.0, 4.0, 6.0, 100.0])  # the median of these five replays is 6 ms

    class FakeEvent:
        def __init__(self, enable_timing=False):
            pass

        def record(self):
            pass

        def elapsed_time(self, end):
            return next(times)

    monkeypatch.setattr(timing, "capture", fake_capture)
    monkeypatch.setattr(timing.torch.cuda, "Event", FakeEvent)
    monkeypatch.setattr(timing.torch.cuda, "synchronize", lambda: None)
    fns = [lambda i=i: order.append(i) for i in range(4)]
    ms = timing.chain_graph_ms(fns, reps=5, warmup=2)
    assert len(captured) == 1  # one graph for the chain
    assert order == ["replay", 0, 1, 2, 3] * 7  # 2 warm-up replays and 5 timed ones, each the whole chain
    assert ms == pytest.approx(6.0 / 4)


def test_eager_decode_interleaved_pairs_the_two_models():
    """Every-step-eager decoding is timed with dense and twell in lockstep: after the prompts and
    the untimed steps, each step of one model is followed by the same step of the other, the
    order swapped every step; one time and one ratio per step; the same tokens."""
    import copy
    import statistics

    from twell.bench.model import _untimed_eager_steps, eager_decode_interleaved

    dense = _model(layers=2, seed=3)
    calibrate_sparsity(dense, 10, torch.randint(0, 300, (2, 64)))
    sparse = sparsify(copy.deepcopy(dense)).eval()
    calls, grad = [], []
    dense.register_forward_pre_hook(lambda *_: calls.append("d"))
    sparse.register_forward_pre_hook(lambda *_: calls.append("t"))
    for m in (dense, sparse):  # no gradient: twell's modules take their inference path
        m.register_forward_pre_hook(lambda *_: grad.append(torch.is_grad_enabled()))
    untimed, timed = _untimed_eager_steps(), 5
    new_tokens = 1 + untimed + timed  # the prompt's forward gives the first token
    out = eager_decode_interleaved(dense, sparse, torch.randint(0, 300, (2, 9)), new_tokens)
    assert calls == ["d", "t"] + ["d", "t"] * untimed + ["d", "t", "t", "d", "d", "t", "t", "d", "d", "t"]
    assert len(grad) == len(calls) and not any(grad)
    for g in (out["dense"], out["twell"]):
        assert g["timed_steps"] == timed and len(g["steps_ms"]) == timed
        assert g["step_ms"] == statistics.median(g["steps_ms"]) and not g["graph"]
    assert out["twell"]["step_ratios"] == [d / t for d, t in zip(out["dense"]["steps_ms"], out["twell"]["steps_ms"])]
    assert out["dense"]["tokens"].shape == (2, 9 + new_tokens)
    assert torch.equal(out["dense"]["tokens"], out["twell"]["tokens"])


def test_bench_shape_parses_d_by_f_and_refuses_anything_else():
    from twell.bench.cli import bench_main, parse_shape

    assert parse_shape("4096x11008") == (4096, 11008)
    assert parse_shape("2048X5632") == (2048, 5632)
    for bad in ("4096", "4096x", "x11008", "4096x11008x2", "0x5632", "4096y11008", "-1x5"):
        with pytest.raises(SystemExit, match="--shape takes DxF"):
            parse_shape(bad)
    # the command refuses a bad shape before it looks for a GPU
    with pytest.raises(SystemExit, match="--shape takes DxF"):
        bench_main(["batch", "--shape", "4096y11008"])


def test_bench_training_no_grid_times_the_steps_only_and_keeps_the_files_grid(tmp_path, monkeypatch):
    """``twell bench training --no-grid``: the train steps replace the file's, its grid records
    and tuning stay as they were, and no grid call is made."""
    import argparse
    import json

    from twell.bench import cli, training

    grid = [dict(M=4096, k=29, distribution="even", dense_ms=2.0, sparse_ms=1.0, sparse_speedup=2.0, dense_path_ms=2.0,
                 dense_path_speedup=1.0, twell_ms=1.0, speedup=2.0, twell_path="sparse", grad_rel_err={"x": 1e-3},
                 max_row_err=1e-3, dense_max_row_err=1e-3, saved_bytes=1, dense_saved_bytes=2)]
    path = tmp_path / "training_mlp_cpu.json"
    path.write_text(json.dumps({"records": grid, "train_step": [{"old": True}], "tuning": {"kept": 1}}))
    new_steps = [dict(preset="0.5b", kernels=k, compile=False, lr=0.0, tokens_per_s=t, peak_bytes=2**30, losses=[1.0],
                      paths=["dense"]) for k, t in (("dense", 100.0), ("auto", 120.0))]
    monkeypatch.setattr(training, "train_step_records", lambda *a, **kw: new_steps)
    monkeypatch.setattr(training, "run_training_grid", lambda *a, **kw: pytest.fail("the grid ran"))
    monkeypatch.setattr(cli, "plot_training", lambda *a, **kw: None)
    args = argparse.Namespace(out=str(tmp_path), variants=False, no_grid=True, no_steps=False, quick=False, M=None,
                              preset=None, k=29, timed_choice=False)
    cli._training_bench(args, "cpu", lambda s: None, 0.0)
    doc = json.loads(path.read_text())
    assert doc["records"] == grid and doc["tuning"] == {"kept": 1}
    assert doc["train_step"] == new_steps


def test_training_grid_runs_every_variant_and_records_the_modules_forced_paths():
    """The training grid end to end on the CPU (Triton interpreter, a tiny shape): every variant
    runs, the gradients of the sparse op and the module match fp32 autograd, and each record
    holds the module's two forced paths and how far "auto" is from the faster of them."""
    from twell.bench.training import run_training_grid

    (rec,) = run_training_grid(Ms=(40,), ks=(3,), distributions=("even",), d=32, f=48, calls=2, log=lambda s: None,
                               plain_module=(), compiled=False, device="cpu", dtype=torch.float32, module_warmup=1)
    assert (rec["M"], rec["k"], rec["distribution"]) == (40, 3, "even")
    for name in ("dense", "sparse", "dense_path", "twell", "dense_l1", "module_sparse", "module_dense"):
        assert rec[f"{name}_ms"] > 0, name
    for name in ("module_sparse", "module_dense"):
        assert rec[f"{name}_speedup"] == pytest.approx(rec["dense_ms"] / rec[f"{name}_ms"])
    faster = max(rec["module_sparse_speedup"], rec["module_dense_speedup"])
    assert rec["module_auto_gap"] == pytest.approx(1 - rec["speedup"] / faster)
    assert rec["auto_gap"] == pytest.approx(1 - rec["speedup"] / max(rec["sparse_speedup"], rec["dense_path_speedup"]))
    assert max(rec["grad_rel_err"].values()) < 1e-4
    assert max(rec["twell_grad_rel_err"].values()) < 1e-4


def test_bench_training_timed_choice_turns_the_timing_on_and_writes_its_own_file(tmp_path, monkeypatch):
    """``twell bench training --timed-choice``: the grid runs with the layers' path timing on,
    no train steps are timed, and the results go to training_timed_choice_<gpu>.json (the
    defaults' training_mlp_<gpu>.json is not touched)."""
    import argparse
    import json

    from twell.bench import cli, training
    from twell.training import path_timing

    monkeypatch.setattr(path_timing, "TIMED_CHOICE", False)  # restored after the test
    seen = []
    rec = dict(M=4096, k=29, distribution="even", dense_ms=2.0, sparse_ms=1.0, sparse_speedup=2.0, dense_path_ms=2.0,
               dense_path_speedup=1.0, twell_ms=1.0, speedup=2.0, twell_path="sparse", module_auto_gap=0.0,
               grad_rel_err={"x": 1e-3}, max_row_err=1e-3, dense_max_row_err=1e-3, saved_bytes=1, dense_saved_bytes=2)

    def grid(*a, **kw):
        seen.append(path_timing.TIMED_CHOICE)
        return [rec]

    monkeypatch.setattr(training, "run_training_grid", grid)
    monkeypatch.setattr(training, "train_step_records", lambda *a, **kw: pytest.fail("train steps ran"))
    monkeypatch.setattr(cli, "plot_training", lambda *a, **kw: None)
    args = argparse.Namespace(out=str(tmp_path), variants=False, no_grid=False, no_steps=False, quick=False, M=[4096],
                              preset=None, k=29, timed_choice=True)
    cli._training_bench(args, "cpu", lambda s: None, 0.0)
    assert seen == [True]
    doc = json.loads((tmp_path / "training_timed_choice_cpu.json").read_text())
    assert doc["timed_choice"] is True and doc["records"] == [rec] and doc["train_step"] == []
    assert not (tmp_path / "training_mlp_cpu.json").exists()
