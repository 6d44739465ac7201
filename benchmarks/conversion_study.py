"""Converting a dense model against training sparse from scratch, on one GPU.

Four runs of one preset (0.5b by default) on one corpus, tokenizer and validation split:

- ``dense``: the preset trained from scratch as a dense model (``twell train --activation silu``:
  Hugging Face's SiLU ``LlamaMLP``, lambda 0) for a token budget;
- ``converted_10``, ``converted_25``: that model exported (``twell export``) and fine-tuned sparse
  (``twell train --init-from EXPORT --l1-target``: SiLU swapped for ReLU, lambda ramped up over a
  quarter of the steps, then steered per layer to the target) for 10% and 25% of the dense run's
  tokens;
- ``scratch_sparse``: the preset trained sparse from scratch with the L1 recipe
  (``--l1-target``) for the dense run's tokens.

For each: the validation loss (the same windows of the validation split for all four), the
active and dead share of hidden units per layer on those windows, and the prefill speedup of the
whole model with twell's MLPs over Hugging Face's on its own trained weights
(:func:`twell.bench.model.bench_model`, as ``twell bench model --model RUN`` runs it, on
``--bench-batch`` sequences of 2048 tokens of the validation split, Hugging Face's default path).
The dense run has SiLU MLPs, which twell does not compute: its row holds the prefill speed of
its own MLPs, the share of its units whose gate is positive (what a conversion to ReLU keeps at
its first step) and no speedup.

Corpus: the Python and Markdown sources of the standard library, ``transformers`` and ``torch``
on the machine (no download). Tokens: a byte-level BPE learnt offline from the corpus's training
split (``twell data tokenizer``; by default with the preset's vocabulary, 49152 for the paper's
presets), then the corpus prepared with it (``twell data prepare``). Each phase learns the
tokenizer anew; it depends only on the corpus, so both phases have the same one, and the report
checks that they do (its hash).

Phases, one process each, each within one 10-minute device call (a 0.5b checkpoint does not
outlive its call, so each phase benchmarks the models it trained):

    python benchmarks/conversion_study.py --phase A --out $OUT [--train-s 180]
        the dense run, its steps fitted to about --train-s seconds from a timed probe (or --steps
        N), the export, converted_10 and converted_25, the benchmark of each:
        conversion_A.json and the runs' logs (conversion_<run>_log.csv); ends by printing the
        command of phase B, with the dense run's steps
    python benchmarks/conversion_study.py --phase B --out $OUT --steps N
        scratch_sparse for N steps (the dense run's) and its benchmark: conversion_B.json and its log
    python benchmarks/conversion_study.py --phase AB --out $OUT [--train-s 80]
        both in one process, the corpus prepared once and B at A's steps: where one device call
        must hold the whole study (a shorter dense run)
    python benchmarks/conversion_study.py --phase report --out DIR
        DIR/conversion_A.json and DIR/conversion_B.json merged into DIR/conversion_<gpu>.json and
        conversion_<gpu>.png (per-layer active and dead shares of every run, validation losses),
        the runs' logs beside them as conversion_<gpu>_<run>_log.csv

Each phase rewrites its JSON after every run, so a phase cut short keeps the runs it finished,
and ends with a table of its runs. ``--preset tiny --train-s 10`` runs every phase on a CPU in a
few minutes (no benchmark without a GPU).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import math
import os
import shutil
import sys
import time
from dataclasses import replace
from pathlib import Path
from typing import Optional

# the corpus and the step timing of the 0.5b study beside this script (benchmarks/trained_model.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from trained_model import corpus_specs, seconds_per_step  # noqa: E402

RUNS = ("dense", "converted_10", "converted_25", "scratch_sparse")
CONVERSIONS = (("converted_10", 0.10), ("converted_25", 0.25))  # (name, share of the dense run's tokens)
PHASE_FILE = "conversion_{}.json"
LOG_FILE = "conversion_{}_log.csv"


def gpu_tag() -> str:
    """The GPU's short name, as twell bench names its files (h100, h200, ...; cpu without one)."""
    from twell.bench.cli import _gpu_tag

    return _gpu_tag()


def machine() -> dict:
    """GPU, library versions and date of this process."""
    import torch
    import transformers

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    return {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "gpu_tag": gpu_tag(),
            "torch": torch.__version__, "triton": triton_version, "transformers": transformers.__version__,
            "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")}


class Clock:
    """Seconds since the phase started, printed with each stage."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.stages: dict[str, float] = {}
        self._last = self.t0

    def mark(self, stage: str, note: str = "") -> None:
        now = time.perf_counter()
        self.stages[stage] = round(now - self._last, 2)
        self._last = now
        print(f"[{now - self.t0:6.0f} s] {stage} ({self.stages[stage]:.0f} s){': ' + note if note else ''}", flush=True)

    @property
    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


# --- data ---------------------------------------------------------------------------------------


def default_vocab(preset: str) -> int:
    """The tokenizer's size: the preset's vocabulary where it fixes one (every embedding row then
    has a token), else 16384."""
    from twell.recipe.model import PRESETS

    return PRESETS[preset].vocab_size or 16384


def prepare_data(a, clock: Clock) -> dict:
    """Learn the tokenizer and prepare the corpus with it under ``--runs-dir``; returns what the
    phase's JSON records of them, with ``folder`` (the prepared corpus)."""
    from twell.recipe.bpe import train_bpe
    from twell.recipe.shards import prepare_corpus

    specs = a.data or corpus_specs()
    runs = Path(a.runs_dir)
    tok_dir, corpus_dir = runs / "tokenizer", runs / "corpus"
    for folder in (tok_dir, corpus_dir):
        shutil.rmtree(folder, ignore_errors=True)
    vocab = a.vocab_size or default_vocab(a.preset)
    tok = train_bpe(specs, tok_dir, vocab_size=vocab, max_chars=int(a.tokenizer_mb * 1e6) or None,
                    val_fraction=a.val_fraction)
    clock.mark("tokenizer", f"byte-level BPE of {tok['vocab_size']:,} ids from {tok['chars'] / 1e6:.1f}M characters "
                            f"of {tok['documents']:,} training documents, sha256 {tok['sha256'][:12]}")
    # the workers are forked processes of one thread each: said here, the tokenizers library does not
    # warn in each of them that this process used its thread pool (to learn the tokenizer)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    index = prepare_corpus(specs, str(tok_dir), corpus_dir, val_fraction=a.val_fraction,
                           workers=min(16, os.cpu_count() or 1), progress=False)
    splits = index["splits"]
    corpus = {"sources": [Path(s).name if s != "stdlib" else s for s in specs], "documents": index["documents"],
              "tokens": index["tokens"], "train_tokens": splits["train"]["stop"] - splits["train"]["start"],
              "validation_tokens": splits["validation"]["stop"] - splits["validation"]["start"],
              "val_fraction": a.val_fraction, "seconds": round(index["seconds"], 2),
              "description": "Python and Markdown sources of the standard library, transformers and torch on the "
                             "machine" if not a.data else "the --data sources"}
    clock.mark("corpus", f"{corpus['documents']:,} documents, {corpus['train_tokens']:,} training and "
                         f"{corpus['validation_tokens']:,} validation tokens")
    tokenizer = {k: tok[k] for k in ("type", "vocab_size", "eos_token", "eos_id", "documents", "chars", "max_chars",
                                     "min_frequency", "sha256", "seconds")}
    return {"tokenizer": tokenizer, "corpus": corpus, "folder": str(corpus_dir)}


def base_config(a, corpus_folder: str):
    """The settings every run shares (each run sets its own model, steps and sparsity)."""
    from twell.recipe.config import TrainConfig

    return TrainConfig(preset=a.preset, data=[corpus_folder], batch_size=a.batch_size, seq_len=a.seq_len,
                       lr=a.lr, progress=False, plot=False, log_every=a.log_every, val_batches=a.val_batches,
                       save_minutes=0, keep=1, seed=0)


def eval_every(steps: int, log_every: int) -> int:
    """About four validation passes, on log steps."""
    return max(1, steps // 4 // log_every) * log_every


# --- measurements -------------------------------------------------------------------------------


def dense_activity(trainer) -> dict:
    """Per layer, on the validation windows the trainer's validation reads: the share of hidden
    units ``act(gate(x)) * up(x)`` that are not zero per token and the units zero for every
    token (a dense model's own activity), and the share of units whose gate is positive per
    token and the units whose gate is positive for no token (what ReLU in place of the
    activation would keep active, and dead, at a conversion's first step)."""
    import contextlib

    import torch

    model, cfg = trainer.model, trainer.cfg
    layers = [layer.mlp for layer in model.model.layers]
    f = trainer.config.intermediate_size
    L = len(layers)
    nonzero = torch.zeros(L, dtype=torch.float64, device=trainer.device)
    positive = torch.zeros(L, dtype=torch.float64, device=trainer.device)
    fired = torch.zeros(L, f, dtype=torch.bool, device=trainer.device)
    opened = torch.zeros(L, f, dtype=torch.bool, device=trainer.device)
    tokens = [0]

    def hook(index):
        def pre(mlp, args):
            x = args[0].reshape(-1, args[0].shape[-1])
            gate = mlp.gate_proj(x)
            h = mlp.act_fn(gate) * mlp.up_proj(x)
            nonzero[index] += (h != 0).sum(dtype=torch.float64)
            positive[index] += (gate > 0).sum(dtype=torch.float64)
            fired[index] |= (h != 0).any(dim=0)
            opened[index] |= (gate > 0).any(dim=0)
            if index == 0:
                tokens[0] += x.shape[0]
        return pre

    handles = [mlp.register_forward_pre_hook(hook(i)) for i, mlp in enumerate(layers)]
    autocast = (torch.autocast(trainer.device.type, dtype=torch.bfloat16) if cfg.precision == "bf16"
                else contextlib.nullcontext())
    model.eval()
    try:
        with torch.no_grad(), autocast:
            for i in range(cfg.val_batches):
                batch = trainer.val_data.eval_batch(i * cfg.batch_size, cfg.batch_size).to(trainer.device)
                model(input_ids=batch[:, :-1], use_cache=False)
    finally:
        for h in handles:
            h.remove()
        model.train()
    n = tokens[0] * f
    return {"active_share_per_layer": (nonzero / n).tolist(), "dead_share_per_layer": (~fired).float().mean(1).tolist(),
            "gate_positive_share_per_layer": (positive / n).tolist(),
            "gate_never_positive_share_per_layer": (~opened).float().mean(1).tolist(), "activity_tokens": tokens[0]}


def validation_tokens(corpus_folder: str):
    """The validation split's ids as one int64 tensor (the benchmark's sequences come from it)."""
    import numpy as np
    import torch

    from twell.recipe.shards import PreparedCorpus

    return torch.from_numpy(np.asarray(PreparedCorpus(corpus_folder).tokens("validation")[:]).astype(np.int64))


def benchmark_ids(tokens, batch: int, seq: int):
    """The prefill's ``[batch, seq]`` ids: the windows :func:`twell.bench.model.bench_model` draws
    from ``tokens`` for its prefill (its first draw from a CUDA generator seeded with 1)."""
    import torch

    stream = tokens.reshape(-1).to("cuda", torch.long)
    gen = torch.Generator(device="cuda").manual_seed(1)
    starts = torch.randint(0, stream.numel() - seq, (batch,), device="cuda", generator=gen)
    return stream[starts.unsqueeze(-1) + torch.arange(seq, device="cuda")]


def prefill_dense_model(model_path: str, tokens, batch: int, seq: int) -> dict:
    """Prefill tokens/ms of a model as it is (the dense run: SiLU MLPs, which twell does not
    compute), bf16, Hugging Face's default path, on :func:`benchmark_ids`: the base model's
    forward, no LM head, timed as bench_model times it."""
    import torch

    from twell.bench.timing import eager_ms
    from twell.recipe.export import load_model

    model = load_model(model_path, dtype=torch.bfloat16).to("cuda").eval()
    ids = benchmark_ids(tokens, batch, seq)
    with torch.no_grad():
        fn = lambda: model.model(input_ids=ids, use_cache=False).last_hidden_state  # noqa: E731
        for _ in range(2):
            fn()
        ms = eager_ms(fn, rep=1500, min_reps=10)
    del model
    torch.cuda.empty_cache()
    return {"prefill_ms": ms, "prefill_tok_per_ms": ids.numel() / ms, "batch": batch, "seq": seq}


def prefill_sparse_model(a, model_path: str, tokens) -> dict:
    """:func:`twell.bench.model.bench_model` of a trained ReLU model, prefill only: Hugging Face's
    MLPs and twell's on the same weights, Hugging Face's default path, ``--bench-batch`` x 2048
    tokens of the validation split."""
    import torch

    from twell.bench.model import bench_model

    res = bench_model(preset=a.preset, model_path=model_path, tokens=tokens, batch=a.bench_batch, seq=a.bench_seq,
                      decode_batches=(), train_batch=0, energy_s=0.0, lean=False, log=lambda m: print(m, flush=True))
    torch.cuda.empty_cache()
    r = {x["variant"]: x for x in res["records"]}
    dense, sparse = r["dense"], r["twell"]
    return {"prefill_speedup": dense["prefill_ms"] / sparse["prefill_ms"],
            "prefill_tok_per_ms": {"dense": dense["prefill_tok_per_ms"], "twell": sparse["prefill_tok_per_ms"]},
            "prefill_ms": {"dense": dense["prefill_ms"], "twell": sparse["prefill_ms"]},
            "rel_err_vs_dense": sparse["rel_err_vs_dense"], "prefill_paths": sparse.get("prefill_paths"),
            "overflow_rows": sparse.get("overflow_rows"), "batch": a.bench_batch, "seq": a.bench_seq,
            "active_per_token_on_benchmark": res["sparsity"]["benchmark_tokens"]["active_mean"]}


# --- runs ---------------------------------------------------------------------------------------


def free() -> None:
    """Give back what the trainers no longer referenced held (the GPU's cached blocks too)."""
    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def run_record(name: str, trainer, summary: dict, wall: float) -> dict:
    """What the study keeps of a finished run (the sparsity entries from its summary: twell's
    statistics on the validation windows)."""
    f = trainer.config.intermediate_size
    active = summary["active_per_token_by_layer"]
    cfg = trainer.cfg
    return {
        "name": name, "steps": summary["steps"], "tokens": summary["tokens"], "batch_tokens": trainer.tokens_per_step,
        "seq_len": cfg.seq_len, "lr": cfg.lr, "activation": cfg.activation,
        "init_from": "the dense run's export" if cfg.init_from else None,
        "l1": cfg.l1, "l1_target": cfg.l1_target, "l1_warmup": cfg.l1_warmup, "reinit": cfg.reinit, "lambda_by_layer": summary["lambda_by_layer"],
        "val_loss": summary["val_loss"], "val_tokens": summary["val_tokens"],
        "active_share_per_layer": [v / f for v in active] if active is not None else None,
        "dead_share_per_layer": summary["dead_frac_val_by_layer"],
        "active_per_token_by_layer": active, "intermediate_size": f, "params": summary["params"],
        "tokens_per_s": summary["tokens_per_s"], "wall_s": round(wall, 2),
        "prefill_speedup": None, "prefill_tok_per_ms": None, "log": LOG_FILE.format(name),
    }


def train_run(name: str, cfg, out: Path, before=None) -> tuple[dict, str]:
    """Train ``cfg`` (``before(trainer)``, if given, runs first and its dict joins the record);
    returns the run's record and checkpoint, with its log copied into ``out``."""
    from twell.recipe.trainer import Trainer

    shutil.rmtree(cfg.out, ignore_errors=True)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    extra = before(trainer) if before else {}
    summary = trainer.fit()
    rec = {**run_record(name, trainer, summary, time.perf_counter() - t0), **extra}
    if name == "dense":
        rec.update(dense_activity(trainer))
    shutil.copy(Path(cfg.out) / "log.csv", out / LOG_FILE.format(name))
    del trainer
    free()
    return rec, summary["checkpoint"]


def at_start(trainer) -> dict:
    """A converted model before its first step: validation loss and active share per layer."""
    ev = trainer.evaluate()
    f = trainer.config.intermediate_size
    return {"val_loss_at_start": ev["val_loss"], "active_share_at_start_per_layer": [v / f for v in ev["active_mean"]],
            "dead_share_at_start_per_layer": ev["dead_frac"]}


def write_phase(out: Path, phase: str, doc: dict) -> None:
    path = out / PHASE_FILE.format(phase)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(path)


def bench_or_note(a, what, *args) -> dict:
    """``what(*args)`` on a GPU; without one (or with --no-bench), a note in its place."""
    import torch

    if not a.bench or not torch.cuda.is_available():
        return {"bench": "not run: " + ("--no-bench" if not a.bench else "no CUDA GPU")}
    return {"bench": what(*args)}


def phase_a(a, out: Path, data: Optional[dict] = None, clock: Optional[Clock] = None) -> int:
    """Phase A (see the module's text); ``data``: a corpus :func:`prepare_data` made already
    (phase AB). Returns the dense run's steps."""
    clock = clock or Clock()
    data = data or prepare_data(a, clock)
    doc = {"phase": "A", "preset": a.preset, **machine(), "tokenizer": data["tokenizer"], "corpus": data["corpus"],
           "settings": settings(a), "runs": [], "seconds": clock.stages}
    base = base_config(a, data["folder"])
    tokens = validation_tokens(data["folder"])
    runs = Path(a.runs_dir)
    dense_cfg = replace(base, activation="silu", out=str(runs / "dense"))
    steps = a.steps
    if steps is None:
        from twell.recipe.trainer import Trainer

        probe = Trainer(replace(dense_cfg, steps=10_000, out=str(runs / "probe")))
        s_step = seconds_per_step(probe)
        del probe
        free()
        # a multiple of 20, so that 10% and 25% of it are whole steps
        steps = max(20, int(a.train_s / (s_step * 1.04)) // 20 * 20)
        clock.mark("probe", f"{s_step * 1e3:.1f} ms per dense step: {steps} steps")
    dense_cfg = replace(dense_cfg, steps=steps, eval_every=eval_every(steps, a.log_every))
    dense, checkpoint = train_run("dense", dense_cfg, out)
    clock.mark("dense", f"val loss {dense['val_loss']:.4f}, {dense['tokens']:,} tokens")
    from twell.recipe.export import export_checkpoint

    export = runs / "dense_hf"
    shutil.rmtree(export, ignore_errors=True)
    export_checkpoint(Path(checkpoint), export)
    clock.mark("export")
    prefill = bench_or_note(a, prefill_dense_model, str(export), tokens, a.bench_batch, a.bench_seq)["bench"]
    dense.update({"bench": prefill, "prefill_tok_per_ms": {"dense": prefill["prefill_tok_per_ms"], "twell": None}
                  if isinstance(prefill, dict) else None})
    doc["runs"].append(dense)
    write_phase(out, "A", doc)
    clock.mark("dense prefill")
    for name, share in CONVERSIONS:
        n = max(1, round(share * steps))
        cfg = replace(base, preset=None, init_from=str(export), lr=a.finetune_lr,
                      l1=a.finetune_l1 if a.finetune_l1 is not None else a.l1, l1_target=a.target, reinit=a.reinit,
                      steps=n, eval_every=eval_every(n, a.log_every), out=str(runs / name))
        rec, checkpoint = train_run(name, cfg, out, before=at_start)
        rec.update(bench_or_note(a, prefill_sparse_model, a, checkpoint, tokens))
        if isinstance(rec["bench"], dict):
            rec["prefill_speedup"] = rec["bench"]["prefill_speedup"]
            rec["prefill_tok_per_ms"] = rec["bench"]["prefill_tok_per_ms"]
            if isinstance(dense["bench"], dict):  # the same process and GPU: against the dense run's own model
                rec["prefill_speedup_vs_dense_run"] = (rec["prefill_tok_per_ms"]["twell"]
                                                       / dense["bench"]["prefill_tok_per_ms"])
        doc["runs"].append(rec)
        write_phase(out, "A", doc)
        clock.mark(name, f"{rec['tokens']:,} tokens, val loss {rec['val_loss']:.4f} (at the start "
                         f"{rec['val_loss_at_start']:.4f}), active share per layer "
                         + " ".join(f"{100 * v:.2f}%" for v in rec["active_share_per_layer"]))
    doc["total_s"] = round(clock.elapsed, 1)
    write_phase(out, "A", doc)
    print(f"\nphase A done in {clock.elapsed:.0f} s; phase B: python benchmarks/conversion_study.py --phase B "
          f"--out OUT --steps {steps}" + (f" --preset {a.preset}" if a.preset != "0.5b" else ""), flush=True)
    print_table(doc["runs"])
    return steps


def phase_b(a, out: Path, data: Optional[dict] = None, clock: Optional[Clock] = None) -> None:
    """Phase B (see the module's text); ``data`` as :func:`phase_a` takes it."""
    clock = clock or Clock()
    data = data or prepare_data(a, clock)
    doc = {"phase": "B", "preset": a.preset, **machine(), "tokenizer": data["tokenizer"], "corpus": data["corpus"],
           "settings": settings(a), "runs": [], "seconds": clock.stages}
    base = base_config(a, data["folder"])
    cfg = replace(base, l1=a.l1, l1_target=a.target, reinit=a.reinit, steps=a.steps,
                  eval_every=eval_every(a.steps, a.log_every), out=str(Path(a.runs_dir) / "scratch_sparse"))
    rec, checkpoint = train_run("scratch_sparse", cfg, out)
    clock.mark("scratch_sparse", f"{rec['tokens']:,} tokens, val loss {rec['val_loss']:.4f}")
    rec.update(bench_or_note(a, prefill_sparse_model, a, checkpoint, validation_tokens(data["folder"])))
    if isinstance(rec["bench"], dict):
        rec["prefill_speedup"] = rec["bench"]["prefill_speedup"]
        rec["prefill_tok_per_ms"] = rec["bench"]["prefill_tok_per_ms"]
    doc["runs"].append(rec)
    clock.mark("bench")
    doc["total_s"] = round(clock.elapsed, 1)
    write_phase(out, "B", doc)
    print(f"\nphase B done in {clock.elapsed:.0f} s", flush=True)
    print_table(doc["runs"])


def settings(a) -> dict:
    """The phase's options, as recorded in its JSON."""
    return {k: v for k, v in vars(a).items() if k not in ("phase", "out", "inputs")}


# --- report -------------------------------------------------------------------------------------


def merge(a_doc: dict, b_doc: dict) -> dict:
    """The study's document from the two phases' (checked: the same preset, tokenizer and corpus,
    and scratch_sparse trained on the dense run's tokens)."""
    problems = []
    if a_doc.get("phase") != "A" or b_doc.get("phase") != "B":
        raise ValueError("give phase A's file, then phase B's")
    if a_doc["preset"] != b_doc["preset"]:
        raise ValueError(f"the phases trained different presets: {a_doc['preset']} and {b_doc['preset']}")
    if a_doc["tokenizer"]["sha256"] != b_doc["tokenizer"]["sha256"]:
        raise ValueError("the phases learnt different tokenizers (their sha256 differ): their losses are not "
                         "comparable; run them on the same corpus and versions")
    if a_doc["corpus"]["tokens"] != b_doc["corpus"]["tokens"]:
        raise ValueError(f"the phases prepared different corpora ({a_doc['corpus']['tokens']:,} and "
                         f"{b_doc['corpus']['tokens']:,} tokens)")
    runs = {r["name"]: {**r, "phase": doc["phase"], "gpu": doc["gpu"]} for doc in (a_doc, b_doc) for r in doc["runs"]}
    missing = [n for n in RUNS if n not in runs]
    if missing:
        problems.append(f"runs missing: {', '.join(missing)}")
    if "dense" in runs and "scratch_sparse" in runs and runs["dense"]["tokens"] != runs["scratch_sparse"]["tokens"]:
        problems.append(f"scratch_sparse trained {runs['scratch_sparse']['tokens']:,} tokens, the dense run "
                        f"{runs['dense']['tokens']:,}: give phase B --steps {runs['dense']['steps']}")
    tags = sorted({a_doc["gpu_tag"], b_doc["gpu_tag"]})
    return {
        "study": "a dense model converted to sparse (twell train --init-from) against training sparse from scratch",
        "preset": a_doc["preset"], "runs": [runs[n] for n in RUNS if n in runs],
        "tokenizer": a_doc["tokenizer"], "corpus": a_doc["corpus"],
        "gpu": a_doc["gpu"] if a_doc["gpu"] == b_doc["gpu"] else f"A: {a_doc['gpu']}; B: {b_doc['gpu']}",
        "gpu_tag": "_".join(tags), "torch": a_doc["torch"], "triton": a_doc["triton"],
        "transformers": a_doc["transformers"], "date": max(a_doc["date"], b_doc["date"]),
        "phases": {d["phase"]: {k: d[k] for k in ("gpu", "torch", "triton", "transformers", "date", "settings",
                                                  "seconds", "total_s") if k in d} for d in (a_doc, b_doc)},
        "problems": problems,
        "method": ("validation loss: mean cross entropy per token (nats) on the first windows of the validation "
                   "split, the same for every run; active share: mean over tokens of the share of a layer's hidden "
                   "units that are not zero; dead share: units zero for every one of those tokens; prefill_speedup: "
                   "twell.bench.model.bench_model on the run's trained weights, Hugging Face's MLPs against twell's "
                   "on the same weights in one process, Hugging Face's default path, bf16; prefill_speedup_vs_dense_run: "
                   "the converted model with twell's MLPs against the dense run's own SiLU model, same process"),
    }


def plot(study: dict, path: Path) -> None:
    """Per-layer active and dead shares of every run, and each run's validation loss."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from matplotlib.ticker import MaxNLocator

    runs = study["runs"]
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.2))
    for r in runs:
        for ax, key in ((axes[0], "active_share_per_layer"), (axes[1], "dead_share_per_layer")):
            if r.get(key):
                ax.plot(range(len(r[key])), [100 * v for v in r[key]], "o-", label=r["name"])
        for ax, key, label in ((axes[0], "gate_positive_share_per_layer", "dense: gate > 0 (ReLU keeps)"),
                               (axes[1], "gate_never_positive_share_per_layer", "dense: gate never > 0 (dead under ReLU)")):
            if r.get(key):
                ax.plot(range(len(r[key])), [100 * v for v in r[key]], "x--", color="gray", label=label)
    targets = {r["l1_target"] for r in runs if r.get("l1_target")}
    for target in targets:
        axes[0].axhline(100 * target, color="black", ls=":", lw=1, label=f"target {100 * target:g}%")
    axes[0].set(xlabel="layer", ylabel="% of hidden units per token", title="active units (validation)", yscale="log")
    axes[1].set(xlabel="layer", ylabel="% of hidden units", title="dead units (validation)")
    for ax in axes[:2]:
        ax.legend(fontsize=7)
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    names = [r["name"] for r in runs]
    bars = axes[2].bar(names, [r["val_loss"] for r in runs], color="tab:blue")
    for bar, r in zip(bars, runs):
        speed = r.get("prefill_speedup")
        axes[2].annotate(f"{r['val_loss']:.3f}" + (f"\nprefill {speed:.2f}x" if speed else ""),
                         (bar.get_x() + bar.get_width() / 2, bar.get_height()), ha="center", va="bottom", fontsize=7)
    low = min(r["val_loss"] for r in runs)
    axes[2].set(ylabel="validation loss (nats/token)", title="validation loss (label: prefill speedup)",
                ylim=(low * 0.9, max(r["val_loss"] for r in runs) * 1.08))
    axes[2].tick_params(axis="x", labelrotation=20)
    fig.suptitle(f"{study['preset']}: dense, converted (--init-from) and sparse from scratch; {study['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report(a, out: Path) -> dict:
    inputs = [Path(p) for p in a.inputs] if a.inputs else [out / PHASE_FILE.format("A"), out / PHASE_FILE.format("B")]
    for path in inputs:
        if not path.is_file():
            raise SystemExit(f"conversion_study report: {path} not found (copy both phases' {PHASE_FILE.format('A')} "
                             f"and {PHASE_FILE.format('B')} into --out, or name them with --inputs)")
    try:
        study = merge(*(json.loads(p.read_text()) for p in inputs))
    except ValueError as err:
        raise SystemExit(f"conversion_study report: {err}")
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"conversion_{study['gpu_tag']}.json"
    for run in study["runs"]:  # the runs' logs beside it, named after the GPU as the study is
        log = run.get("log")
        src = inputs[0 if run.get("phase") == "A" else 1].parent / log if log else None
        if src is not None and src.is_file():
            run["log"] = f"conversion_{study['gpu_tag']}_{run['name']}_log.csv"
            if src.resolve() != (out / run["log"]).resolve():
                shutil.copy(src, out / run["log"])
    path.write_text(json.dumps(study, indent=1))
    plot(study, path.with_suffix(".png"))
    for problem in study["problems"]:
        print(f"warning: {problem}", file=sys.stderr)
    print(f"{path} and {path.with_suffix('.png').name}")
    print_table(study["runs"])
    return study


def print_table(runs: list[dict]) -> None:
    """One line per run: tokens, validation loss, active and dead shares, prefill speedup."""
    def pct(values: Optional[list], how) -> str:
        return "-" if not values else f"{100 * how(values):.2f}%"

    print(f"\n{'run':16}{'tokens':>13}{'val loss':>10}{'active mean':>13}{'active max':>12}{'dead mean':>11}"
          f"{'prefill':>9}")
    for r in runs:
        speed = r.get("prefill_speedup")
        print(f"{r['name']:16}{r['tokens']:>13,}{r['val_loss']:>10.4f}"
              f"{pct(r.get('active_share_per_layer'), lambda v: sum(v) / len(v)):>13}"
              f"{pct(r.get('active_share_per_layer'), max):>12}"
              f"{pct(r.get('dead_share_per_layer'), lambda v: sum(v) / len(v)):>11}"
              f"{'-' if speed is None or (isinstance(speed, float) and math.isnan(speed)) else f'{speed:.3f}x':>9}",
              flush=True)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog="Phases: A (dense, export, converted_10, converted_25), B (scratch_sparse, "
                                "--steps of the dense run), AB (both in one process), report (merge). See the module's docstring.")
    p.add_argument("--phase", choices=["A", "B", "AB", "report"], required=True)
    p.add_argument("--out", required=True, help="the phase's JSON and logs; for report, where both phases' JSON lie")
    p.add_argument("--inputs", nargs=2, metavar=("A_JSON", "B_JSON"), help="report: the phases' files (default: in --out)")
    p.add_argument("--preset", default="0.5b")
    p.add_argument("--train-s", type=float, default=180.0, help="A: seconds of dense training to fit its steps to "
                   "(default 180: phase A then ends in about 8 minutes on an H100)")
    p.add_argument("--steps", type=int, help="A: the dense run's steps (no probe); B: required, the dense run's steps")
    p.add_argument("--batch-size", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's context)")
    p.add_argument("--lr", type=float, default=6e-4, help="peak learning rate from scratch (dense, scratch_sparse)")
    p.add_argument("--finetune-lr", type=float, help="peak learning rate of the converted runs (default: twell "
                   "train's with --init-from)")
    p.add_argument("--l1", type=float, default=1e-4, help="lambda the sparse runs start from (default 1e-4)")
    p.add_argument("--finetune-l1", type=float, help="lambda the converted runs ramp up to before the controller "
                   "steers it (default: --l1); short conversions reach the target sooner from a larger one")
    p.add_argument("--target", type=float, default=0.01, help="active share per layer the sparse runs steer to "
                   "(--l1-target; default 0.01)")
    p.add_argument("--reinit", action=argparse.BooleanOptionalAction, default=None,
                   help="whether the sparse runs re-initialise dead units' gate rows (twell train --reinit, the "
                   "paper's Eq. 6; default: the recipe's, on)")
    p.add_argument("--log-every", type=int, default=5, help="steps between log rows, where lambda adapts (default 5)")
    p.add_argument("--val-batches", type=int, default=16, help="validation micro-batches (default 16)")
    p.add_argument("--data", nargs="+", help="corpus (default: stdlib, transformers and torch sources)")
    p.add_argument("--val-fraction", type=float, default=0.02)
    p.add_argument("--vocab-size", type=int, help="the tokenizer's ids (default: the preset's vocabulary, else 16384)")
    p.add_argument("--tokenizer-mb", type=float, default=32.0, help="million characters the tokenizer learns from "
                   "(default 32; 0: all the training split)")
    p.add_argument("--bench-batch", type=int, default=16, help="sequences of the prefill benchmark (default 16)")
    p.add_argument("--bench-seq", type=int, default=2048, help="tokens per sequence of the prefill benchmark")
    p.add_argument("--no-bench", dest="bench", action="store_false", help="skip the prefill benchmarks")
    p.add_argument("--runs-dir", default="/tmp/twell_conversion", help="checkpoints, export, tokenizer, corpus")
    return p


def main(argv=None) -> None:
    a = parser().parse_args(argv)
    out = Path(a.out)
    if a.phase == "report":
        report(a, out)
        return
    if a.phase == "B" and a.steps is None:
        raise SystemExit("conversion_study: phase B needs --steps N, the dense run's steps (phase A prints them)")
    for name in ("steps", "batch_size", "seq_len", "log_every", "val_batches", "bench_batch", "bench_seq"):
        value = getattr(a, name)
        if value is not None and value < 1:
            raise SystemExit(f"conversion_study: --{name.replace('_', '-')} must be >= 1, got {value}")
    from twell.recipe.model import PRESETS

    if a.preset not in PRESETS:
        raise SystemExit(f"conversion_study: unknown preset {a.preset!r}; choose one of {', '.join(PRESETS)}")
    out.mkdir(parents=True, exist_ok=True)
    Path(a.runs_dir).mkdir(parents=True, exist_ok=True)
    if a.phase == "AB":  # both in one process: the corpus prepared once, B at A's steps
        clock = Clock()
        data = prepare_data(a, clock)
        a.steps = phase_a(a, out, data, clock)
        phase_b(a, out, data, clock)
        return
    (phase_a if a.phase == "A" else phase_b)(a, out)


if __name__ == "__main__":
    main()
