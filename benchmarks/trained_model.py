"""A sparse model we trained: the 0.5b preset trained on one GPU with the L1
recipe to at most 1% active units per token in every layer, a lambda = 0 run of the same budget,
and the whole-model benchmark (:func:`twell.bench.model.bench_model`) of the sparse one.

The corpus is Python and Markdown sources found on the machine, byte tokens, no download: the
standard library, and the packages ``transformers`` and ``torch`` (about 110M bytes). lambda is
per layer, adapted toward ``--target`` active units per token (``twell train --l1-target``),
starting from ``--l1``: one fixed lambda reaches 1% on some layers long before others (layer 0
of the small preset sat at 2% with lambda = 0 while layer 7 held 24%).

Two phases, one process each (a phase fits in one 10-minute device call):

    python benchmarks/trained_model.py --phase sparse --out $OUT --train-s 270
        times the model, trains for about --train-s seconds, evaluates, saves the checkpoint,
        then benchmarks it against dense on the same weights (prefill, decode, training step,
        memory, energy), on windows of its validation split;
        writes trained_sparse.json, trained_sparse_log.csv, trained_sparse.png, model_trained.json
    python benchmarks/trained_model.py --phase dense --out $OUT --steps N
        the lambda = 0 run with the sparse run's N steps; writes trained_dense.json

``--preset tiny --train-s 20 --no-bench`` smoke-tests the script on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shutil
import time
from dataclasses import replace
from pathlib import Path

import torch

from twell.recipe.data import build_streams, load_tokenizer
from twell.recipe.trainer import TrainConfig, Trainer


def corpus_specs() -> list[str]:
    """stdlib plus the source folders of transformers and torch (their .py/.md/.txt files)."""
    import transformers

    return ["stdlib", os.path.dirname(transformers.__file__), os.path.dirname(torch.__file__)]


def seconds_per_step(trainer: Trainer, warmup: int = 5, timed: int = 15) -> float:
    for _ in range(warmup):
        trainer.train_step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(timed):
        trainer.train_step()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return (time.perf_counter() - t0) / timed


def run_record(trainer: Trainer, summary: dict, wall: float) -> dict:
    import transformers

    return {
        **{k: summary[k] for k in ("preset", "params", "steps", "tokens", "val_loss", "ppl", "bits_per_byte",
                                   "active_per_token", "active_per_token_by_layer", "active_max_by_layer",
                                   "dead_frac_val_by_layer", "dead_frac_window_by_layer", "tokens_per_s",
                                   "l1_target", "lambda_by_layer")},
        "lambda": trainer.cfg.l1, "f": trainer.config.intermediate_size, "lr": trainer.cfg.lr,
        "batch_tokens": trainer.tokens_per_step, "seq_len": trainer.cfg.seq_len, "wall_s": wall,
        "active_share_by_layer": [a / trainer.config.intermediate_size for a in summary["active_per_token_by_layer"]],
        "val_tokens": summary["val_tokens"], "corpus": "stdlib + transformers + torch sources, byte tokens",
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
        "transformers": transformers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--phase", choices=["sparse", "dense"], required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="0.5b")
    p.add_argument("--train-s", type=float, default=270.0, help="sparse phase: training seconds to fit the steps to")
    p.add_argument("--steps", type=int, help="fixed steps (the dense phase: the sparse run's)")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--lr", type=float, default=6e-4)
    p.add_argument("--l1", type=float, default=2e-5, help="lambda to start from (sparse phase)")
    p.add_argument("--target", type=float, default=0.008, help="active share per layer to steer to (sparse phase)")
    p.add_argument("--dead-limit", type=float, help="hold the lambda of a layer whose dead share exceeds this (twell "
                   "train's --dead-limit; default off, as the committed results were made)")
    p.add_argument("--runs-dir", default="/tmp/twell_trained")
    p.add_argument("--no-bench", dest="bench", action="store_false")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    t_start = time.perf_counter()
    base = TrainConfig(preset=a.preset, data=corpus_specs(), batch_size=a.batch_size, lr=a.lr, progress=False,
                       plot=True, log_every=10, val_batches=16, save_minutes=0, keep=1,
                       l1=a.l1 if a.phase == "sparse" else 0.0,
                       l1_target=a.target if a.phase == "sparse" else None, dead_limit=a.dead_limit)
    tok = load_tokenizer("bytes")
    streams = build_streams(base.data, tok, base.val_fraction)
    print(f"corpus: {len(streams[0]):,} train / {len(streams[1]):,} validation tokens "
          f"({time.perf_counter() - t_start:.0f} s)", flush=True)
    steps = a.steps
    if steps is None:
        probe = Trainer(replace(base, steps=10_000, out=f"{a.runs_dir}/probe"), streams=streams)
        s_step = seconds_per_step(probe)
        del probe
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        steps = max(50, int(a.train_s / (s_step * 1.04)) // 10 * 10)
        print(f"{s_step * 1e3:.1f} ms/step: {steps} steps", flush=True)
    cfg = replace(base, steps=steps, eval_every=max(10, steps // 4 // 10 * 10), out=f"{a.runs_dir}/{a.phase}")
    shutil.rmtree(cfg.out, ignore_errors=True)
    t0 = time.perf_counter()
    trainer = Trainer(cfg, streams=streams)
    summary = trainer.fit()
    rec = run_record(trainer, summary, time.perf_counter() - t0)
    (out / f"trained_{a.phase}.json").write_text(json.dumps(rec, indent=1))
    for name, dst in (("log.csv", f"trained_{a.phase}_log.csv"), ("training.png", f"trained_{a.phase}.png")):
        if (Path(cfg.out) / name).exists():
            shutil.copy(Path(cfg.out) / name, out / dst)
    print(f"{a.phase}: val loss {rec['val_loss']:.4f}, active share per layer "
          + " ".join(f"{100 * v:.2f}%" for v in rec["active_share_by_layer"])
          + f", trained in {rec['wall_s']:.0f} s", flush=True)
    checkpoint = summary["checkpoint"]
    del trainer
    if a.phase != "sparse" or not a.bench:
        return
    torch.cuda.empty_cache()
    from twell.bench.model import bench_model

    res = bench_model(preset=a.preset, model_path=checkpoint, tokens=torch.from_numpy(streams[1].astype("int64")),
                      energy_s=2.0, new_tokens=64, log=lambda m: print(m, flush=True))
    (out / "model_trained.json").write_text(json.dumps(res, indent=1, default=str))
    r = {x["variant"]: x for x in res["records"]}
    d, t = r["dense"], r["twell"]
    print(f"\n{'':28}{'dense':>10}{'twell':>10}{'ratio':>8}")
    for key in ("prefill_tok_per_ms", "prefill_lean_tok_per_ms", "decode_tok_per_s_b1", "decode_lean_tok_per_s_b1",
                "decode_tok_per_s_b16", "train_tok_per_s", "mj_per_token", "mj_per_token_lean", "peak_bytes"):
        if d.get(key) and t.get(key):
            print(f"{key:28}{d[key]:>10.4g}{t[key]:>10.4g}{t[key] / d[key]:>7.3f}x")
    print(f"done in {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
