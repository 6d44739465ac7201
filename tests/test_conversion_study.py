"""benchmarks/conversion_study.py end to end on the CPU: phase A (tokenizer, corpus, the dense
SiLU run with its step probe, export, converted_10 and converted_25), phase B (scratch_sparse)
and the report merging them, with the tiny preset and tiny budgets (no benchmark without a GPU)."""

import importlib.util
import json
from pathlib import Path

import pytest

from test_train_loss import small_corpus

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "conversion_study.py"


def load_script():
    spec = importlib.util.spec_from_file_location("conversion_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture
def study(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    small_corpus(data)
    common = ["--preset", "tiny", "--data", str(data), "--vocab-size", "300", "--seq-len", "32", "--batch-size", "2",
              "--val-batches", "1", "--val-fraction", "0.2", "--runs-dir", str(tmp_path / "runs")]
    return load_script(), common


def test_the_phases_and_the_report(tmp_path, study, capsys):
    script, common = study
    # --train-s far below a step: the probe runs and the dense run gets the fewest steps, 20
    script.main(["--phase", "A", "--out", str(tmp_path / "a"), "--train-s", "0.01", *common])
    printed = capsys.readouterr().out
    assert "--phase B --out OUT --steps 20 --preset tiny" in printed
    a = json.loads((tmp_path / "a" / "conversion_A.json").read_text())
    assert [r["name"] for r in a["runs"]] == ["dense", "converted_10", "converted_25"]
    for name in ("dense", "converted_10", "converted_25"):
        assert (tmp_path / "a" / f"conversion_{name}_log.csv").is_file()
    script.main(["--phase", "B", "--out", str(tmp_path / "b"), "--steps", "20", *common])
    b = json.loads((tmp_path / "b" / "conversion_B.json").read_text())
    assert [r["name"] for r in b["runs"]] == ["scratch_sparse"]
    same = lambda tok: {k: v for k, v in tok.items() if k != "seconds"}  # noqa: E731
    assert same(b["tokenizer"]) == same(a["tokenizer"])  # learnt anew, the same

    report = tmp_path / "report"
    script.main(["--phase", "report", "--out", str(report), "--inputs", str(tmp_path / "a" / "conversion_A.json"),
                 str(tmp_path / "b" / "conversion_B.json")])
    out = capsys.readouterr().out
    assert "scratch_sparse" in out.splitlines()[-1]  # the table comes last
    doc = json.loads((report / "conversion_cpu.json").read_text())
    assert (report / "conversion_cpu.png").is_file()
    for key in ("runs", "tokenizer", "corpus", "gpu", "torch", "triton", "transformers", "date"):
        assert key in doc, key
    assert doc["problems"] == [] and doc["gpu"] == "cpu" and doc["tokenizer"]["vocab_size"] == 300
    runs = {r["name"]: r for r in doc["runs"]}
    assert list(runs) == ["dense", "converted_10", "converted_25", "scratch_sparse"]
    batch_tokens = 2 * 32
    assert runs["dense"]["tokens"] == runs["scratch_sparse"]["tokens"] == 20 * batch_tokens
    assert runs["converted_10"]["tokens"] == 2 * batch_tokens and runs["converted_25"]["tokens"] == 5 * batch_tokens
    for r in doc["runs"]:
        # each run's log copied beside the study, named after the GPU, the same rows as its phase's
        assert r["log"] == f"conversion_cpu_{r['name']}_log.csv"
        phase_dir = tmp_path / ("b" if r["name"] == "scratch_sparse" else "a")
        assert (report / r["log"]).read_text() == (phase_dir / f"conversion_{r['name']}_log.csv").read_text()
        assert isinstance(r["val_loss"], float) and 0 < r["val_loss"] < 10
        assert r["val_tokens"] == runs["dense"]["val_tokens"]  # the same validation windows
        assert len(r["active_share_per_layer"]) == len(r["dead_share_per_layer"]) == 4
        assert all(0 <= v <= 1 for v in r["active_share_per_layer"] + r["dead_share_per_layer"])
        assert "prefill_speedup" in r and r["prefill_speedup"] is None  # no GPU: not benchmarked
        assert r["bench"] == "not run: no CUDA GPU"
    dense = runs["dense"]
    assert dense["activation"] == "silu" and dense["l1"] == 0 and min(dense["active_share_per_layer"]) > 0.99
    assert all(0 < v < 1 for v in dense["gate_positive_share_per_layer"])
    for name in ("converted_10", "converted_25"):
        r = runs[name]
        assert r["activation"] == "relu" and r["init_from"] and r["l1_target"] == 0.01
        assert r["active_share_at_start_per_layer"] == pytest.approx(dense["gate_positive_share_per_layer"], abs=0.02)
        assert isinstance(r["val_loss_at_start"], float)
    assert runs["scratch_sparse"]["init_from"] is None and runs["scratch_sparse"]["l1_target"] == 0.01


def test_the_report_refuses_phases_with_different_tokenizers(tmp_path, study):
    script, _ = study
    run = {"name": "dense", "tokens": 10, "steps": 1, "val_loss": 1.0}
    phase = {"preset": "tiny", "tokenizer": {"sha256": "x"}, "corpus": {"tokens": 5}, "gpu": "cpu", "gpu_tag": "cpu",
             "torch": "t", "triton": "t", "transformers": "t", "date": "d", "runs": [run]}
    (tmp_path / "conversion_A.json").write_text(json.dumps({**phase, "phase": "A"}))
    (tmp_path / "conversion_B.json").write_text(json.dumps({**phase, "phase": "B", "tokenizer": {"sha256": "y"},
                                                            "runs": [{**run, "name": "scratch_sparse"}]}))
    with pytest.raises(SystemExit, match="the phases learnt different tokenizers"):
        script.main(["--phase", "report", "--out", str(tmp_path)])


def test_phase_b_needs_the_dense_runs_steps(tmp_path, study):
    script, common = study
    with pytest.raises(SystemExit, match="phase B needs --steps N"):
        script.main(["--phase", "B", "--out", str(tmp_path / "b"), *common])
    assert not (tmp_path / "b").exists()


def test_phase_ab_runs_both_on_one_corpus(tmp_path, study, capsys):
    script, common = study
    script.main(["--phase", "AB", "--out", str(tmp_path / "ab"), "--train-s", "0.01", "--l1", "2e-4",
                 "--finetune-l1", "7e-4", *common])
    a = json.loads((tmp_path / "ab" / "conversion_A.json").read_text())
    b = json.loads((tmp_path / "ab" / "conversion_B.json").read_text())
    assert [r["name"] for r in a["runs"]] == ["dense", "converted_10", "converted_25"]
    assert [r["name"] for r in b["runs"]] == ["scratch_sparse"]
    # the conversions start from --finetune-l1, the run from scratch from --l1
    assert [r["l1"] for r in a["runs"][1:]] == [7e-4, 7e-4] and b["runs"][0]["l1"] == 2e-4
    assert [r["reinit"] for r in a["runs"][1:] + b["runs"]] == [True] * 3  # (the recipe's default)
    assert b["runs"][0]["tokens"] == a["runs"][0]["tokens"]  # B at A's steps
    assert b["tokenizer"] == a["tokenizer"] and b["corpus"] == a["corpus"]  # prepared once
    assert capsys.readouterr().out.count("] tokenizer (") == 1
    script.main(["--phase", "report", "--out", str(tmp_path / "ab")])
    assert json.loads((tmp_path / "ab" / "conversion_cpu.json").read_text())["problems"] == []


def test_no_reinit_reaches_every_sparse_run(tmp_path, study):
    script, common = study
    script.main(["--phase", "AB", "--out", str(tmp_path / "ab"), "--train-s", "0.01", "--no-reinit", "--no-bench", *common])
    a = json.loads((tmp_path / "ab" / "conversion_A.json").read_text())
    b = json.loads((tmp_path / "ab" / "conversion_B.json").read_text())
    assert [r["reinit"] for r in a["runs"]] == [False] * 3 and b["runs"][0]["reinit"] is False
