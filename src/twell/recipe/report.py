"""What a run shows and leaves behind: progress bar, CSV (and TensorBoard) log, summary, plot."""

from __future__ import annotations

import csv
import json
import math
from pathlib import Path
from typing import Optional

from tqdm.auto import tqdm

__all__ = ["RunLogger", "format_summary", "plot_history", "draw_history", "read_history", "describe_validation",
           "model_label"]

CSV_NAME = "log.csv"


def _number(text: str):
    """A CSV cell as the number it was written from: ``"40960"`` -> int, ``"1.5"`` -> float, so
    that a log rewritten on ``--resume`` keeps its integer columns integers."""
    try:
        return int(text)
    except ValueError:
        return float(text)


def read_history(path: Path) -> list[dict]:
    """The rows of a run's CSV log as dicts of numbers (empty cells -> absent)."""
    if not Path(path).is_file():
        return []
    with open(path, newline="") as fh:
        return [{k: _number(v) for k, v in row.items() if v not in ("", None)} for row in csv.DictReader(fh)]


def model_label(preset, init_from, activation: str = "relu") -> str:
    """What a run trained, in a few words: ``preset tiny``, ``from FOLDER`` (``--init-from``) or
    ``preset tiny, dense silu`` (a dense baseline, ``--activation silu``)."""
    if init_from:
        return f"from {init_from}"
    return f"preset {preset}" + (f", dense {activation}" if activation != "relu" else "")


def describe_validation(val_loss: float, ppl: float, tokens: int, windows: int, seq_len: int, bytes_: bool) -> str:
    """What a validation loss is and what it was measured on, in one line (``twell train``'s
    summary and ``twell eval`` print the same)."""
    bits = f", {val_loss / math.log(2):.3f} bits per byte" if bytes_ else ""
    return (f"validation loss {val_loss:.4f} nats/token (perplexity {ppl:.3f}{bits}) on {tokens:,} tokens: "
            f"the first {windows:,} windows of {seq_len} tokens of the validation split")


class RunLogger:
    """Progress bar, CSV log and TensorBoard (if installed) for a :class:`~twell.recipe.trainer.Trainer`.

    Only rank 0 logs (``enabled``). On ``--resume`` into the same folder, CSV rows after the
    checkpoint's step are dropped, so the log reads as one uninterrupted run.
    """

    def __init__(self, trainer, enabled: bool = True):
        self.t, self.enabled = trainer, enabled
        self.out = Path(trainer.cfg.out)
        self.bar = None
        self.tb = None
        self.columns: Optional[list[str]] = None

    def start(self) -> None:
        if not self.enabled:
            return
        t, cfg = self.t, self.t.cfg
        self.out.mkdir(parents=True, exist_ok=True)
        kept = [r for r in read_history(self.out / CSV_NAME) if r["step"] <= t.step] if t.step else []
        t.history = kept + t.history
        self._write_all(kept)
        try:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(self.out / "tensorboard"))
        except ImportError:  # tensorboard is optional: pip install 'twell[tensorboard]'
            self.tb = None
        except Exception as err:  # a broken install must not stop the run
            tqdm.write(f"TensorBoard logging off: {type(err).__name__}: {err}")
            self.tb = None
        f = t.config.intermediate_size
        label = model_label(cfg.preset, cfg.init_from, cfg.activation)
        if t.converted_from not in (None, "relu"):
            tqdm.write(f"note: {cfg.init_from}: its MLPs used {t.converted_from}; they train with ReLU in its place from "
                       "here (a different function: the first steps' loss is the converted model's)")
        penalty = (f"Hugging Face's {cfg.activation} MLPs, cross entropy alone (lambda 0, no sparsity statistics)"
                   if t.dense else
                   f"lambda {cfg.l1:g} (L1 = mean over layers of mean over tokens of SUM over units of |h|)")
        tqdm.write(
            f"twell train: {label}, {t.n_params / 1e6:.2f}M params, "
            f"{t.config.num_hidden_layers} layers x {f} hidden units, "
            f"{t.world} process(es) on {t.device.type}, {cfg.precision}\n"
            f"  data {' '.join(cfg.data)} ({len(t.train_data.tokens):,} train / {len(t.val_data.tokens):,} validation "
            f"tokens, tokenizer {t.tokenizer.name}); {cfg.steps} steps x {t.tokens_per_step:,} tokens; {penalty}"
            + (f", ramped up over {cfg.l1_warmup} steps" if cfg.l1_warmup else "")
            + ("; dead-unit reinit on" if cfg.reinit else "")
            + (f"\n  resumed at step {t.step}" if t.step else "")
        )
        self.bar = tqdm(total=cfg.steps, initial=t.step, desc="train", unit="step", disable=not cfg.progress,
                        dynamic_ncols=True, mininterval=1.0)

    def tick(self) -> None:
        if self.bar is not None:
            self.bar.update(1)

    def _write_all(self, rows: list[dict]) -> None:
        """Write the CSV log anew with ``rows`` (columns: ``self.columns``, else the first row's)."""
        path = self.out / CSV_NAME
        if not rows:
            if path.exists():
                path.unlink()
            return
        if self.columns is None:
            self.columns = [k for k in rows[0] if k != "val_loss"] + ["val_loss"]
        with open(path, "w", newline="") as fh:
            w = csv.DictWriter(fh, fieldnames=self.columns, restval="", extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)

    def log(self, row: dict) -> None:
        """Append ``row`` (already the last of the trainer's history) to the CSV log, TensorBoard
        and the progress bar."""
        if not self.enabled:
            return
        new = [k for k in row if k not in (self.columns or [])]
        if new:  # the first row, or columns an older version's log (resumed) did not have
            old = [k for k in (self.columns or []) if k != "val_loss"]
            self.columns = old + [k for k in new if k != "val_loss"] + ["val_loss"]
            self._write_all(self.t.history)
        else:
            with open(self.out / CSV_NAME, "a", newline="") as fh:
                csv.DictWriter(fh, fieldnames=self.columns, restval="").writerow(row)
        if self.tb is not None:
            for k, v in row.items():
                if k != "step" and isinstance(v, (int, float)) and math.isfinite(v):
                    self.tb.add_scalar(k if "_L" not in k else f"layers/{k}", v, row["step"])
        f = self.t.config.intermediate_size
        # The throughput shown is the run's average so far, the figure the summary ends with
        # (log.csv's tokens_per_s column has each row's own interval).
        speed = self.t.throughput or 0.0
        sparse = "active_mean" in row  # (a dense run has no sparsity columns)
        if self.bar is not None:
            self.bar.set_postfix_str(
                f"loss {row['ce']:.3f}"
                + (f" | active {row['active_mean']:.1f}/{f} ({100 * (1 - row['active_mean'] / f):.1f}% sparse)" if sparse else "")
                + f" | {speed:,.0f} tok/s", refresh=False)
        if "val_loss" in row:
            dead = row.get("dead_frac", math.nan)
            tqdm.write(
                f"step {row['step']:>6} | loss {row['ce']:.4f} | val {row['val_loss']:.4f}"
                + (f" | active/token {row['active_mean']:.1f} of {f} ({100 * (1 - row['active_mean'] / f):.2f}% sparse), "
                   f"max {row['active_max']} | dead {'-' if math.isnan(dead) else f'{100 * dead:.1f}%'}" if sparse else "")
                + f" | {speed:,.0f} tok/s"
                + (f" | sparse kernels in {row['sparse_layers']} of {len(self.t.modules)} layers"
                   if self.t.device.type == "cuda" and sparse else ""))

    def close(self) -> None:
        """Close the progress bar and TensorBoard (also when the run stops early)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.tb is not None:
            self.tb.close()
            self.tb = None

    def finish(self, final: dict) -> dict:
        """Write the summary (printed, and summary.json) and the plot; returns the summary."""
        t = self.t
        summary = make_summary(t, final)
        if not self.enabled:
            return summary
        self.close()
        if t.cfg.plot and t.history:
            summary["plot"] = str(plot_history(t.history, self.out / "training.png", t.config.intermediate_size,
                                               title=f"twell train: {model_label(t.cfg.preset, t.cfg.init_from, t.cfg.activation)}, "
                                                     f"lambda {t.cfg.l1:g}", dead_limit=summary["dead_limit"]))
        (self.out / "summary.json").write_text(json.dumps(summary, indent=1))
        print(format_summary(summary))
        return summary


def make_summary(t, final: dict) -> dict:
    """The end-of-run numbers: validation, sparsity per layer, dead units, where things are. A
    dense run (``activation`` other than ReLU) has no sparsity: those entries are None."""
    f = t.config.intermediate_size
    L = t.config.num_hidden_layers
    active = final["active_mean"]
    dead_window = t.dead.dead_frac if active is not None else None
    return {
        "preset": t.cfg.preset, "init_from": t.cfg.init_from, "activation": t.cfg.activation,
        "params": t.n_params, "steps": t.step, "tokens": t.samples_seen * t.cfg.seq_len,
        "lambda": t.cfg.l1, "l1_warmup": t.cfg.l1_warmup, "reinit": t.cfg.reinit, "intermediate_size": f,
        "l1_target": t.cfg.l1_target,
        "lambda_by_layer": [t.cfg.l1 * c for c in t.l1_scale] if t.cfg.l1_target is not None else None,
        "val_loss": final["val_loss"], "ppl": final["ppl"], "val_tokens": final["tokens"],
        "val_windows": final["windows"], "seq_len": t.cfg.seq_len,
        "bits_per_byte": final["val_loss"] / math.log(2) if t.tokenizer.name == "bytes" else None,
        "active_per_token": sum(active) / L if active is not None else None,
        "active_per_token_by_layer": active, "active_max_by_layer": final["active_max"],
        "dead_frac_val_by_layer": final["dead_frac"],
        "dead_frac_window_by_layer": dead_window,
        # each layer's largest window share of dead units over the run's log rows
        "dead_frac_window_max_by_layer": _largest(t.history, "dead_frac_L", L) if active is not None else None,
        "dead_frac": (sum(dead_window) / L) if dead_window else None,
        "dead_window_tokens": t.cfg.dead_window * t.tokens_per_step,
        # with a target: the limit on each layer's dead share, and the log rows at which it held a layer's lambda
        "dead_limit": t.cfg.dead_limit if t.cfg.l1_target is not None else None,
        "dead_holds_by_layer": list(t.dead_holds) if t.cfg.l1_target is not None else None,
        "reinit_unit_steps": int(t.dead.reinit_count) if t.cfg.reinit else None,
        "skipped_steps": t.skipped,
        # this process's steps only: validation, checkpoints and the steps before a resume left out
        "tokens_per_s": t.throughput,
        "checkpoint": str(Path(t.cfg.out) / "checkpoints" / f"step_{t.step:06d}"),
        "log": str(Path(t.cfg.out) / CSV_NAME),
    }


def _largest(history: list[dict], prefix: str, layers: int) -> Optional[list[float]]:
    """Per layer, the largest finite value of the ``{prefix}{i}`` column of the log rows (None
    where no row has one)."""
    out = []
    for i in range(layers):
        values = [r[f"{prefix}{i}"] for r in history if math.isfinite(r.get(f"{prefix}{i}", float("nan")))]
        out.append(max(values) if values else None)
    return out if any(v is not None for v in out) else None


def format_summary(s: dict) -> str:
    f = s["intermediate_size"]
    lines = [
        "",
        f"== summary: {model_label(s['preset'], s.get('init_from'), s.get('activation', 'relu'))}, {s['steps']} steps, "
        f"{s['tokens']:,} tokens, lambda {s['lambda']:g}" + (", reinit on" if s.get("reinit") else ""),
        describe_validation(s["val_loss"], s["ppl"], s["val_tokens"], s["val_windows"], s["seq_len"],
                            s.get("bits_per_byte") is not None),
    ]
    if s["active_per_token_by_layer"] is not None:
        lines += _sparsity_lines(s)
    if s.get("skipped_steps"):
        lines.append(f"skipped steps (NaN or Inf loss or gradient): {s['skipped_steps']}")
    if s.get("tokens_per_s"):
        lines.append(f"throughput {s['tokens_per_s']:,.0f} tokens/s (this run's training steps; validation and "
                     "checkpoints not counted)")
    for key in ("checkpoint", "log", "plot"):
        if s.get(key):
            lines.append(f"{key}: {s[key]}")
    return "\n".join(lines)


def _sparsity_lines(s: dict) -> list[str]:
    """The summary's lines on sparsity: active and dead units per layer, lambdas, holds."""
    f = s["intermediate_size"]
    lines = [
        f"active units per token: {s['active_per_token']:.1f} of {f} on average "
        f"({100 * (1 - s['active_per_token'] / f):.2f}% sparse)",
        f"{'layer':>5} {'active/token':>12} {'max':>6} {'dead (train window)':>20} {'dead (validation)':>18} "
        f"{'most dead (window)':>19}",
    ]
    L = len(s["active_per_token_by_layer"])
    win = s.get("dead_frac_window_by_layer") or [None] * L
    most = s.get("dead_frac_window_max_by_layer") or [None] * L
    for i, (a, m, dv, dw, dm) in enumerate(zip(s["active_per_token_by_layer"], s["active_max_by_layer"],
                                               s["dead_frac_val_by_layer"], win, most)):
        dws = "-" if dw is None else f"{round(dw * f)} ({100 * dw:.1f}%)"
        dms = "-" if dm is None else f"{100 * dm:.1f}%"
        lines.append(f"{i:>5} {a:>12.1f} {m:>6} {dws:>20} {f'{round(dv * f)} ({100 * dv:.1f}%)':>18} {dms:>19}")
    if s.get("lambda_by_layer"):
        lines.append(f"lambda per layer (adapted toward {100 * s['l1_target']:g}% active): "
                     + " ".join(f"{v:.3g}" for v in s["lambda_by_layer"]))
    holds = s.get("dead_holds_by_layer")
    if holds and any(holds):
        lines.append(f"lambda held (dead share over {100 * s['dead_limit']:g}%), log rows per layer: "
                     + " ".join(str(h) for h in holds))
    if s.get("dead_window_tokens"):
        lines.append(f"dead (train window): fired for none of the last {s['dead_window_tokens']:,} training tokens; "
                     "dead (validation): for none of the validation tokens; most dead: the largest window share "
                     "of the run's log rows")
    return lines


def _layers(history: list[dict], prefix: str) -> list[int]:
    """The layer numbers of the ``{prefix}{i}`` columns of a log, in order."""
    return sorted({int(k[len(prefix):]) for r in history for k in r if k.startswith(prefix) and k[len(prefix):].isdigit()})


def plot_history(history: list[dict], path: Path, width: int, title: str = "",
                 dead_limit: Optional[float] = None) -> Path:
    """PNG of training/validation loss, active units per token and dead units over steps (see
    :func:`draw_history`); returns its path."""
    import matplotlib.pyplot as plt

    fig = draw_history(history, width, title, dead_limit)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def draw_history(history: list[dict], width: int, title: str = "", dead_limit: Optional[float] = None):
    """The figure of :func:`plot_history`: three panels, loss (training and validation), active
    units per token and dead units, the last two with one line per layer (of ``width`` units)
    and the mean over layers in black. Dead units: lines for the training window's share, dots
    for the validation passes'; ``dead_limit`` (the run's ``--dead-limit`` under a target), a
    dashed line. A log without sparsity columns (a dense run): the loss panel alone."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    sparse = any("active_mean" in r for r in history)
    fig, axes = plt.subplots(1, 3 if sparse else 1, figsize=(15 if sparse else 6, 4), squeeze=False)
    axes = axes[0]
    axes[0].plot(steps, [r["ce"] for r in history], label="train CE")
    val = [(r["step"], r["val_loss"]) for r in history if "val_loss" in r]
    if val:
        axes[0].plot(*zip(*val), "o-", label="validation CE")
    axes[0].set(xlabel="step", ylabel="loss (nats/token)", title="loss")
    axes[0].legend()
    if not sparse:
        if title:
            fig.suptitle(title)
        fig.tight_layout()
        return fig
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for i in _layers(history, "active_mean_L"):
        axes[1].plot(steps, [r.get(f"active_mean_L{i}", float("nan")) for r in history], lw=0.8, alpha=0.6,
                     color=colors[i % len(colors)], label=f"layer {i}")
    axes[1].plot(steps, [r["active_mean"] for r in history], "k-", lw=2, label="mean over layers")
    axes[1].set(xlabel="step", ylabel=f"active units per token (of {width})", title="sparsity", yscale="log")
    axes[1].legend(fontsize=7)
    for i in _layers(history, "dead_frac_L"):
        color = colors[i % len(colors)]
        axes[2].plot(steps, [100 * r.get(f"dead_frac_L{i}", float("nan")) for r in history], lw=0.8, alpha=0.6,
                     color=color, label=f"layer {i}")
        dots = [(r["step"], 100 * r[f"dead_frac_val_L{i}"]) for r in history if f"dead_frac_val_L{i}" in r]
        if dots:
            axes[2].plot(*zip(*dots), "o", ms=3, color=color)
    axes[2].plot(steps, [100 * r.get("dead_frac", float("nan")) for r in history], "k-", lw=2, label="mean over layers")
    if dead_limit is not None:
        axes[2].axhline(100 * dead_limit, color="gray", ls="--", lw=1, label="limit (lambda held above)")
    axes[2].set(xlabel="step", ylabel="% of units", title="dead units (lines: training window; dots: validation)")
    axes[2].legend(fontsize=7)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    return fig
