"""Lambda sweep of the ReLU + L1 recipe on one GPU: the small preset, equal token budget.

Runs lambda in {0, 1e-5, 2e-5, 3e-5} and lambda 2e-5 with dead-unit re-initialisation (Eq. 6),
one after the other in one process, on the standard library corpus of the running Python.
The token budget is set from a short timing of the model so that the five runs fit in
``--budget-s`` seconds, and is the same for every run. Writes, under ``--out``:

    sparsity_sweep_h200.json   one flat record per run (after each run, so a cut run keeps data)
    sparsity_sweep_h200.png    validation loss, active units per layer, curves, dead units
    sparsity_sweep_h200_curves.csv   the training logs of all runs

Usage (on the GPU machine): python benchmarks/sparsity_sweep.py --out $OUT --budget-s 420
"""

from __future__ import annotations

import argparse
import csv
import datetime
import json
import time
from dataclasses import replace
from pathlib import Path

import torch

from twell.recipe.data import build_streams, load_tokenizer
from twell.recipe.trainer import TrainConfig, Trainer

RUNS = [(0.0, False), (1e-5, False), (2e-5, False), (3e-5, False), (2e-5, True)]


def run_config(base: TrainConfig, steps: int, lam: float, reinit: bool, runs_dir: str) -> TrainConfig:
    """One run's settings: ``base`` with its steps, lambda and re-init, about 4 validation passes."""
    name = f"l1_{lam:g}" + ("_reinit" if reinit else "")
    return replace(base, steps=steps, l1=lam, reinit=reinit, out=f"{runs_dir}/{name}", eval_every=max(1, steps // 4))


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def timed_steps(trainer: Trainer, n: int) -> float:
    """Seconds per optimizer step over ``n`` steps (after the caller's warm-up)."""
    _sync()
    t0 = time.perf_counter()
    for _ in range(n):
        trainer.train_step()
    _sync()
    return (time.perf_counter() - t0) / n


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--budget-s", type=float, default=420.0, help="wall time for the five runs together")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--runs-dir", default="/tmp/twell_sweep")
    p.add_argument("--preset", default="small", help="small for the experiment; tiny to smoke-test on a CPU")
    p.add_argument("--steps", type=int, help="fix the steps per run instead of fitting them to --budget-s")
    a = p.parse_args()
    t_start = time.perf_counter()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    base = TrainConfig(preset=a.preset, batch_size=a.batch_size, progress=False, plot=False, log_every=25, val_batches=16)
    tok = load_tokenizer("bytes")
    try:
        streams = build_streams(base.data, tok, base.val_fraction)
    except FileNotFoundError as err:  # an image without the stdlib sources: use torch's instead
        import os

        print(f"{err}; falling back to torch's Python sources", flush=True)
        base = replace(base, data=[os.path.dirname(torch.__file__) + "/**/*.py"])
        streams = build_streams(base.data, tok, base.val_fraction)
    print(f"corpus: {len(streams[0]):,} train / {len(streams[1]):,} validation tokens", flush=True)

    # Time the model: a few warm-up steps, then timed ones, with the L1 term and statistics on.
    probe = Trainer(replace(base, steps=10_000, out=f"{a.runs_dir}/probe"), streams=streams)
    timed_steps(probe, 5)
    s_per_step = timed_steps(probe, 20)
    del probe
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    overhead_s = 12.0  # per run: build, 7 validation passes, checkpoint (estimated)
    left = a.budget_s - (time.perf_counter() - t_start)
    steps = int((left / len(RUNS) - overhead_s) / (s_per_step * 1.08)) // 50 * 50
    steps = a.steps or max(steps, 100)
    tokens_per_step = base.batch_size * TrainConfig.resolved(base).seq_len
    print(f"{s_per_step * 1e3:.1f} ms/step ({tokens_per_step / s_per_step:,.0f} tok/s): {steps} steps "
          f"= {steps * tokens_per_step / 1e6:.1f}M tokens per run", flush=True)

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    date = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d")
    import transformers

    records, curves = [], []
    for lam, reinit in RUNS:
        cfg = run_config(base, steps, lam, reinit, a.runs_dir)
        name = Path(cfg.out).name
        t0 = time.perf_counter()
        trainer = Trainer(cfg, streams=streams)
        s = trainer.fit()
        wall = time.perf_counter() - t0
        f = s["intermediate_size"]
        rec = {
            "run": name, "lambda": lam, "reinit": reinit, "preset": a.preset, "params": s["params"],
            "intermediate_size": f, "layers": len(s["active_per_token_by_layer"]), "seq_len": cfg.seq_len if cfg.seq_len else 1024,
            "batch_tokens": trainer.tokens_per_step, "steps": s["steps"], "tokens": s["tokens"],
            "val_loss": s["val_loss"], "val_tokens": None, "active_per_token": s["active_per_token"],
            "active_per_token_by_layer": s["active_per_token_by_layer"], "active_max_by_layer": s["active_max_by_layer"],
            "sparsity": 1 - s["active_per_token"] / f,
            "dead_frac": s["dead_frac"], "dead_frac_by_layer": s["dead_frac_window_by_layer"],
            "dead_window_tokens": s["dead_window_tokens"], "dead_frac_val": sum(s["dead_frac_val_by_layer"]) / len(s["dead_frac_val_by_layer"]),
            "tokens_per_s": s["tokens_per_s"], "wall_s": wall, "reinit_unit_steps": s["reinit_unit_steps"], "lr": trainer.cfg.lr,
            "gpu": gpu, "torch": torch.__version__, "transformers": transformers.__version__, "date": date,
            "corpus": " ".join(base.data) + " (python sources, byte tokens)",
        }
        rec["seq_len"] = trainer.cfg.seq_len
        rec["val_tokens"] = trainer.cfg.val_batches * trainer.cfg.batch_size * trainer.cfg.seq_len
        records.append(rec)
        for r in trainer.history:
            curves.append({"run": name, **{k: v for k, v in r.items() if "_L" not in k}})
        dense = next((r["val_loss"] for r in records if r["lambda"] == 0), None)
        for r in records:
            r["val_loss_increase_vs_lambda0"] = (r["val_loss"] / dense - 1) if dense else None
        (out / "sparsity_sweep_h200.json").write_text(json.dumps(records, indent=1))
        print(f"{name}: val {rec['val_loss']:.4f} | active {rec['active_per_token']:.1f}/{f} "
              f"({100 * rec['sparsity']:.2f}% sparse) | dead {rec['dead_frac']} | {rec['tokens_per_s']:,.0f} tok/s | "
              f"{wall:.0f} s", flush=True)
        del trainer
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    keys = sorted({k for c in curves for k in c}, key=lambda k: (k != "run", k != "step", k))
    with open(out / "sparsity_sweep_h200_curves.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        w.writerows(curves)
    plot(records, curves, out / "sparsity_sweep_h200.png")
    print(table(records))
    print(f"total {time.perf_counter() - t_start:.0f} s")


def table(records) -> str:
    lines = ["| lambda | reinit | val loss | vs lambda 0 | active/token (of f) | sparsity | dead units | tokens/s |",
             "|---|---|---|---|---|---|---|---|"]
    for r in records:
        inc = r.get("val_loss_increase_vs_lambda0")
        dead = "-" if r["dead_frac"] is None else f"{100 * r['dead_frac']:.1f}%"
        lines.append(f"| {r['lambda']:g} | {'on' if r['reinit'] else 'off'} | {r['val_loss']:.4f} | "
                     f"{'-' if inc is None else f'{100 * inc:+.2f}%'} | {r['active_per_token']:.1f} ({r['intermediate_size']}) | "
                     f"{100 * r['sparsity']:.2f}% | {dead} | {r['tokens_per_s']:,.0f} |")
    return "\n".join(lines)


def plot(records, curves, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(2, 2, figsize=(12, 8))
    names = [r["run"] for r in records]
    ax[0, 0].bar(names, [r["val_loss"] for r in records], color="C0")
    lo = min(r["val_loss"] for r in records)
    ax[0, 0].set(ylim=(lo * 0.98, max(r["val_loss"] for r in records) * 1.01), ylabel="validation loss (nats/byte)",
                 title="validation loss")
    for i, r in enumerate(records):
        ax[0, 1].plot(range(len(r["active_per_token_by_layer"])), r["active_per_token_by_layer"], "o-", label=r["run"])
    ax[0, 1].set(xlabel="layer", ylabel=f"active units per token (of {records[0]['intermediate_size']})",
                 yscale="log", title="active units per token, by layer (validation)")
    ax[0, 1].legend(fontsize=8)
    for name in names:
        pts = [(c["step"], c["active_mean"]) for c in curves if c["run"] == name]
        ax[1, 0].plot(*zip(*pts), label=name)
    ax[1, 0].set(xlabel="step", ylabel="active units per token (mean over layers)", yscale="log", title="sparsity during training")
    ax[1, 0].legend(fontsize=8)
    ax[1, 1].bar(names, [100 * (r["dead_frac"] or 0) for r in records], color="C3")
    ax[1, 1].set(ylabel="% of units", title=f"dead units (no firing over the last {records[0]['dead_window_tokens'] / 1e6:.1f}M tokens)")
    for a_ in (ax[0, 0], ax[1, 1]):
        a_.tick_params(axis="x", labelrotation=20)
    r0 = records[0]
    fig.suptitle(f"twell {r0['preset']} preset ({r0['params'] / 1e6:.0f}M params), {r0['tokens'] / 1e6:.0f}M tokens per run, {r0['gpu']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()
