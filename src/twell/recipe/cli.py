"""``twell train``, ``twell eval`` and ``twell export``.

Each parses and checks its arguments, and finds the checkpoint it is given, before torch and
transformers are imported (seconds), so that ``--help`` and argument errors answer at once.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import fields
from pathlib import Path

from .config import ACTIVATIONS, DEFAULT_L1, TrainConfig
from .model import PRESETS

__all__ = ["train_main", "eval_main", "export_main", "train_parser", "eval_parser", "export_parser"]

LOSS_HELP = """\
loss = cross_entropy + lambda * l1_loss, where
  l1_loss = mean over layers of (mean over tokens of SUM over the f hidden units of |h|),
  h = relu(gate(x)) * up(x) the hidden activation of each MLP.
The sum over units is the convention of the paper's published training code (its equation
writes a mean, with which 2e-5 would be f times weaker); lambda = 2e-5 is the paper's setting.

With no arguments: the tiny preset on the Python standard library's sources (no download),
5 to 11 minutes on a 2-core CPU; it ends with a summary and runs/twell/training.png.

Examples:
  twell train
  twell train --preset small --steps 2000 --l1 3e-5 --out runs/small
  twell train --data corpus/*.jsonl --tokenizer HuggingFaceTB/SmolLM-135M --preset 0.5b
  torchrun --nproc_per_node 8 -m twell train --preset 1b --grad-checkpointing [--fsdp]
  twell train --init-from llama-hf --data corpus/ --l1-target 0.02 --out runs/sparse-llama
  twell train --activation silu --out runs/dense   (a dense baseline: Hugging Face's MLPs, lambda 0)
  twell train --resume runs/twell        (continues exactly from the newest checkpoint)
  twell export runs/twell runs/twell-hf  (a Hugging Face folder, from any checkpoint)

Ctrl-C (SIGINT) or SIGTERM saves a checkpoint at the end of the step under way and prints the
command that resumes it. A step whose loss or gradient is NaN or Inf is skipped with a warning.
"""


def train_parser() -> argparse.ArgumentParser:
    """Every option defaults to SUPPRESS, so that on --resume only the options given on the
    command line override the checkpoint's settings. The defaults shown come from TrainConfig."""
    d = TrainConfig()
    p = argparse.ArgumentParser(prog="twell train", description="Train a sparse language model: Llama-style, "
                                "ReLU-gated MLPs, L1 penalty on their hidden activations.", epilog=LOSS_HELP,
                                formatter_class=argparse.RawDescriptionHelpFormatter, argument_default=argparse.SUPPRESS)
    m = p.add_argument_group("model")
    m.add_argument("--preset", choices=list(PRESETS), help=f"model size (default {d.preset}); see twell.recipe.model")
    m.add_argument("--hidden-size", type=int, help="override the preset's d")
    m.add_argument("--intermediate-size", type=int, help="override the preset's f (hidden units per MLP)")
    m.add_argument("--num-layers", type=int, help="override the preset's layer count")
    m.add_argument("--num-heads", type=int, help="override the preset's attention heads")
    m.add_argument("--activation", choices=list(ACTIVATIONS), help=f"the MLPs' activation (default {d.activation}): "
                   "relu trains twell's sparse MLPs with the L1 recipe; silu trains a dense baseline, the preset "
                   "with Hugging Face's own LlamaMLP and lambda 0 (no --l1, --l1-target, --l1-warmup or --reinit), "
                   "whose export --init-from can convert")
    m.add_argument("--init-from", metavar="FOLDER", help="start from a Hugging Face causal LM folder (config.json, "
                   "weights, tokenizer; Llama, Qwen2, Mistral, a twell export) instead of a preset's random weights: "
                   "its architecture and tokenizer are used, its MLPs converted to ReLU (as twell convert does); "
                   "lambda ramps up over --l1-warmup, by default a quarter of --steps. Not with --fsdp")
    g = p.add_argument_group("data")
    g.add_argument("--data", nargs="+", help="'stdlib' (default: this Python's standard library sources), "
                   "files/folders/globs of .txt .md .rst .py .jsonl .parquet, hf:NAME[:CONFIG], or a folder "
                   "from `twell data prepare` (read from disk; it brings its tokenizer and split)")
    g.add_argument("--tokenizer", help="'bytes' (default) or a Hugging Face tokenizer path or name")
    g.add_argument("--text-field", help=f"JSONL field / Parquet column with the text (default {d.text_field})")
    g.add_argument("--val-fraction", type=float, help=f"share of documents held out, by hash of their key (default {d.val_fraction})")
    g.add_argument("--max-docs", type=int, help="read at most this many documents of an hf: dataset")
    g.add_argument("--seq-len", type=int, help="tokens per sequence (default: the preset's context; with "
                   "--init-from the model's, at most 2048)")
    o = p.add_argument_group("optimisation")
    o.add_argument("--steps", type=int, help=f"optimizer steps (default {d.steps})")
    o.add_argument("--batch-size", type=int, help=f"sequences per micro-batch per process (default {d.batch_size})")
    o.add_argument("--grad-accum", type=int, help=f"micro-batches per step (default {d.grad_accum})")
    o.add_argument("--lr", type=float, help="peak learning rate (default: tiny 3e-3, small 1.5e-3, else 3e-4; "
                   "with --init-from 1e-4)")
    o.add_argument("--min-lr-ratio", type=float, help=f"cosine floor as a share of --lr (default {d.min_lr_ratio})")
    o.add_argument("--warmup", type=int, help="learning-rate warm-up steps (default min(100, steps/10))")
    o.add_argument("--weight-decay", type=float, help=f"AdamW weight decay on matrices, the tied embedding/output "
                   f"matrix included (default {d.weight_decay})")
    o.add_argument("--grad-clip", type=float, help=f"clip the gradient norm to this, 0 = off (default {d.grad_clip})")
    o.add_argument("--max-bad-steps", type=int, help="a step whose loss or gradient is NaN or Inf is skipped with a "
                   f"warning; after this many in a row the run stops, saving the last good state (default {d.max_bad_steps})")
    o.add_argument("--seed", type=int, help=f"initialisation and data order (default {d.seed})")
    s = p.add_argument_group("sparsity")
    s.add_argument("--l1", type=float, help=f"lambda, the L1 coefficient, sum-over-units convention (default {DEFAULT_L1:g}; 0 with --activation silu)")
    s.add_argument("--l1-warmup", type=int, help="ramp lambda linearly from 0 over this many steps (default 0: off; "
                   "with --init-from a quarter of --steps)")
    s.add_argument("--l1-target", type=float, help="target share of active units per token in EVERY layer, e.g. "
                   "0.01: each layer's lambda starts at --l1 and is multiplied by up to 1.25 (or divided) at every "
                   "log step, by the square root of the layer's active share over the target, within 1e-6 to 1e6 "
                   "times --l1, not during --l1-warmup (default: off, one fixed lambda)")
    s.add_argument("--dead-window", type=int, help=f"steps in the window over which a unit that never fires counts as dead (default {d.dead_window})")
    s.add_argument("--dead-limit", type=float, metavar="SHARE", help="with --l1-target: a layer whose share of dead units "
                   "over the window exceeds SHARE keeps its lambda from rising (neither the target's adaptation nor "
                   f"the --l1-warmup ramp raises it) until its share falls back (default {d.dead_limit})")
    s.add_argument("--no-dead-limit", dest="dead_limit", action="store_const", const=None,
                   help="no dead-unit limit: every layer's lambda follows the target alone")
    s.add_argument("--reinit", action="store_true", help="re-initialise dead units' gate rows after every step "
                   "(paper's Eq. 6; the default for twell's ReLU MLPs)")
    s.add_argument("--no-reinit", dest="reinit", action="store_const", const=False,
                   help="leave dead units dead (the dead-unit limit still holds their layer's lambda)")
    s.add_argument("--reinit-keep", type=float, help=f"Eq. 6: W <- keep * W + (1 - keep) * N(0, std^2) (default keep {d.reinit_keep})")
    s.add_argument("--reinit-std", type=float, help=f"Eq. 6 noise std (default {d.reinit_std})")
    r = p.add_argument_group("run")
    r.add_argument("--out", help=f"output folder: log.csv, training.png, summary.json, checkpoints/ (default {d.out})")
    r.add_argument("--log-every", type=int, help=f"steps between log lines/statistics (default {d.log_every})")
    r.add_argument("--eval-every", type=int, help="steps between validation passes (default steps/6)")
    r.add_argument("--val-batches", type=int, help=f"validation micro-batches per pass and process (default {d.val_batches})")
    r.add_argument("--save-every", type=int, help="steps between checkpoints (default: only by --save-minutes, and "
                   "at the end); Ctrl-C (SIGINT) and SIGTERM also save one, at the end of the step under way")
    r.add_argument("--save-minutes", type=float, help="also save a checkpoint when this much wall time has passed since "
                   f"the last one: what a hard kill can lose (default {d.save_minutes:g}; 0: off)")
    r.add_argument("--keep", type=int, help=f"keep the newest N step checkpoints in OUT/checkpoints, deleting older "
                   f"ones; the newest, at the end the final one, is always kept (default {d.keep}; 0: keep all)")
    r.add_argument("--resume", help="a checkpoint folder, or a run's --out folder (its newest checkpoint); "
                   "the run continues in the run folder the checkpoint lies in (unless --out is given) and "
                   "the checkpoint's settings apply, except options given on the command line (--lr, "
                   "--weight-decay and the schedule's --steps/--warmup/--min-lr-ratio included)")
    r.add_argument("--device", help="cpu, cuda or cuda:N (default: cuda if available)")
    r.add_argument("--precision", choices=["bf16", "fp32"], help="bf16 autocast (default on GPUs) or fp32")
    r.add_argument("--kernels", choices=["auto", "dense", "sparse"], help="the MLPs' training kernels on GPUs: "
                   "sparse (twell's exact sparse forward and backward), dense (cuBLAS and fused element-wise passes), or auto (default: sparse "
                   "for each layer while its measured sparsity makes them faster, on micro-batches of at least "
                   "twell.training.path.MIN_SPARSE_TOKENS = 8192 tokens)")
    r.add_argument("--grad-checkpointing", action="store_true", help="recompute activations in the backward pass")
    r.add_argument("--compile", action="store_true", help="torch.compile each decoder layer before training (as "
                   "torchtitan does: one graph that every layer shares, built during the first steps); the MLPs "
                   "keep training on twell's kernels, each layer choosing sparse or dense at run time inside "
                   "twell's custom ops (twell.training.ops). Works with --fsdp and --grad-checkpointing")
    r.add_argument("--fsdp", action="store_true", help="under torchrun: shard parameters, optimizer state and "
                   "checkpoints with FSDP2 instead of DDP (built on the meta device: no rank holds the whole model)")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    r.add_argument("--no-plot", dest="plot", action="store_false", help="no training.png")
    return p


def _config_from(args: dict, base: dict) -> TrainConfig:
    names = {f.name for f in fields(TrainConfig)}
    merged = {**base, **{k: v for k, v in args.items() if k in names}}
    if "betas" in merged:
        merged["betas"] = tuple(merged["betas"])
    return TrainConfig(**merged)


def _is_main_process() -> bool:
    return os.environ.get("RANK", "0") == "0"


def train_main(argv=None) -> dict:
    """Entry point of ``twell train`` (also under torchrun). Returns the summary dict."""
    args = vars(train_parser().parse_args(sys.argv[1:] if argv is None else argv))
    resume = args.pop("resume", None)
    if "init_from" in args:
        given = [f"--{name.replace('_', '-')}" for name in ("preset", "tokenizer") if name in args]
        if resume:
            raise SystemExit("twell train: --init-from starts a run from a model folder, --resume continues one "
                             "from its checkpoint: give one of them")
        if given:
            raise SystemExit(f"twell train: --init-from brings the model and its tokenizer: leave out {' and '.join(given)}")
    base = {}
    if resume:
        from .checkpoint import latest_checkpoint

        try:
            saved = latest_checkpoint(Path(resume)) / "train_config.json"
        except FileNotFoundError as err:
            raise SystemExit(f"twell train --resume: {err}")
        base = json.loads(saved.read_text())
        where = saved.resolve()  # (resolved: "--resume step_000020" from inside checkpoints/ too)
        if "out" not in args and where.parent.parent.name == "checkpoints":
            # Continue in the run folder the checkpoint lies in, not the --out it was written
            # with: a run copied or moved elsewhere would otherwise write into the original.
            run = where.parent.parent.parent
            if base.get("out") and Path(base["out"]).resolve() != run and _is_main_process():
                print(f"note: continuing in {run} (the checkpoint's settings name --out {base['out']})", file=sys.stderr)
            base["out"] = str(run)
        if base.get("fsdp") and "fsdp" not in args and int(os.environ.get("WORLD_SIZE", "1")) == 1:
            # A sharded checkpoint loads on any number of ranks: in one process, unsharded.
            base["fsdp"] = False
            print(f"note: {saved.parent} was written by an FSDP run; resuming in one process, without FSDP",
                  file=sys.stderr)
    try:
        cfg = _config_from(args, base)
        cfg.resolved(resuming=bool(resume))  # every value checked before the trainer (torch, transformers) is imported
    except ValueError as err:
        raise SystemExit(f"twell train: {err}")

    from .trainer import RunStopped, train

    try:
        return train(cfg, resume=resume)
    except RunStopped as stop:  # saved: say where and how to resume, no traceback
        if _is_main_process():
            print(f"twell train: {stop}", file=sys.stderr, flush=True)
        raise SystemExit(stop.exit_code)
    except KeyboardInterrupt:  # Ctrl-C before the loop started, or a second one to quit at once
        if _is_main_process():
            print("twell train: interrupted; nothing saved since the last checkpoint", file=sys.stderr, flush=True)
        raise SystemExit(130)
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise SystemExit(f"twell train: {err}")


def eval_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twell eval", description="Validation loss, perplexity and sparsity of a "
                                "checkpoint (a folder that twell train wrote, or any save_pretrained Llama; a model whose "
                                "activation is not ReLU is evaluated with ReLU in its place, and the output says so, "
                                "except a dense baseline of twell train --activation, evaluated as trained: its loss alone). "
                                "By default it reads the windows that the training run's validation passes read, so "
                                "its loss is the one the run's summary reports for the same checkpoint.")
    p.add_argument("checkpoint", help="checkpoint folder, or a run's --out folder (its newest checkpoint)")
    p.add_argument("--data", nargs="+", help="corpus (default: the one the checkpoint was trained on)")
    p.add_argument("--tokenizer", help="default: the checkpoint's")
    p.add_argument("--val-fraction", type=float, help="default: the checkpoint's")
    p.add_argument("--seq-len", type=int, help="default: the checkpoint's")
    p.add_argument("--batch-size", type=int, help="default: the checkpoint's")
    p.add_argument("--val-batches", type=int, help="micro-batches to evaluate (default: as many as the training run's "
                   "validation read, its --val-batches x processes; 8 for a folder twell train did not write)")
    p.add_argument("--device", help="default: cuda if available")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    return p


def eval_main(argv=None) -> dict:
    """Entry point of ``twell eval CHECKPOINT``: validation loss, perplexity and sparsity."""
    a = eval_parser().parse_args(sys.argv[1:] if argv is None else argv)
    for key in ("seq_len", "batch_size", "val_batches"):
        value = getattr(a, key)
        if value is not None and value < (2 if key == "seq_len" else 1):
            raise SystemExit(f"twell eval: --{key.replace('_', '-')} must be >= {2 if key == 'seq_len' else 1}, got {value}")
    if a.device and a.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            raise SystemExit(f"twell eval: device {a.device!r} asked for, but torch sees no CUDA GPU; use --device cpu")

    from .checkpoint import model_folder, read_meta, run_settings, run_tokenizer

    path = model_folder(a.checkpoint, "twell eval")
    saved = run_settings(path)
    export_info = path / "twell_export.json"  # a `twell export` folder: the run's world size is noted there
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in {f.name for f in fields(TrainConfig)}})
    for key in ("data", "val_fraction", "seq_len", "batch_size"):
        if getattr(a, key) is not None:
            setattr(cfg, key, getattr(a, key))
    # By default the windows the run's validation passes read: val_batches micro-batches on each process.
    state = path / "trainer_state.safetensors"
    world = int(read_meta(state).get("world_size", 1)) if state.is_file() else 1
    if not state.is_file() and export_info.is_file():
        world = int(json.loads(export_info.read_text()).get("world_size") or 1)
    batches = a.val_batches or (cfg.val_batches * world if saved else TrainConfig().val_batches)
    hidden_act = json.loads((path / "config.json").read_text()).get("hidden_act")

    import torch
    from transformers.utils import logging as hf_logging

    from ..hf import activation_note, sparsify
    from .corpus import load_corpus
    from .data import load_tokenizer
    from .export import load_model
    from .report import describe_validation
    from .trainer import evaluate_lm

    # a dense baseline (twell train --activation silu) is evaluated as it was trained: no sparse MLPs
    dense = cfg.activation != "relu" and hidden_act == cfg.activation
    note = None if dense else activation_note(hidden_act)
    if note:  # on stderr, so that --json output stays parseable
        print(f"note: {path}: {note}; it is evaluated with ReLU, not as it was trained", file=sys.stderr)
    device = torch.device(a.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    tok_spec = a.tokenizer or run_tokenizer(path, cfg.tokenizer)
    try:
        tokenizer = load_tokenizer(tok_spec)
    except ValueError as err:
        raise SystemExit(f"twell eval: {err}")
    hf_logging.disable_progress_bar()  # keep the report to what twell prints
    model = load_model(path, dtype=torch.float32)  # a sharded checkpoint's shards assembled here
    if not dense:
        sparsify(model)
    model.to(device)
    seq_len = cfg.seq_len or model.config.max_position_embeddings
    try:
        _, val_data = load_corpus(cfg.data, tokenizer, seq_len, cfg.seed, cfg.val_fraction, cfg.text_field, cfg.max_docs)
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise SystemExit(f"twell eval: {err}")
    precision = "bf16" if device.type == "cuda" else "fp32"
    ev = evaluate_lm(model, val_data, cfg.batch_size, batches, device, precision, sparsity=not dense)
    f = model.config.intermediate_size
    result = {"checkpoint": str(path), "val_loss": ev["val_loss"], "ppl": ev["ppl"], "tokens": ev["tokens"],
              "windows": ev["windows"], "seq_len": seq_len, "hidden_act": hidden_act,
              "evaluated_act": hidden_act if dense else "relu", "intermediate_size": f}
    if not dense:
        L = len(ev["active_mean"])
        result.update({"active_per_token": sum(ev["active_mean"]) / L, "active_per_token_by_layer": ev["active_mean"],
                       "active_max_by_layer": ev["active_max"], "dead_frac_val_by_layer": ev["dead_frac"],
                       "sparsity": 1 - sum(ev["active_mean"]) / L / f})
    if a.json:
        print(json.dumps(result, indent=1))
    else:
        print(f"{path}: " + describe_validation(ev["val_loss"], ev["ppl"], ev["tokens"], ev["windows"], seq_len,
                                                  tokenizer.name == "bytes"))
        if dense:
            print(f"dense {hidden_act} MLPs (twell train --activation {hidden_act}): no sparsity to report")
            return result
        print(f"active units per token {result['active_per_token']:.1f} of {f} ({100 * result['sparsity']:.2f}% sparse)")
        print(f"{'layer':>5} {'active/token':>12} {'max':>6} {'dead (validation)':>18}")
        for i, (am, mx, dv) in enumerate(zip(ev["active_mean"], ev["active_max"], ev["dead_frac"])):
            print(f"{i:>5} {am:>12.1f} {mx:>6} {f'{round(dv * f)} ({100 * dv:.1f}%)':>18}")
    return result


def export_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="twell export", description="Write a checkpoint as a Hugging Face model folder: "
                                "config, safetensors weights and the run's tokenizer, which "
                                "AutoModelForCausalLM.from_pretrained and twell eval load. Takes both kinds of checkpoint: "
                                "sharded (FSDP runs, torch.distributed.checkpoint; assembled here, in one process) and "
                                "safetensors. The optimizer state is left out.")
    p.add_argument("checkpoint", help="checkpoint folder, or a run's --out folder (its newest complete checkpoint)")
    p.add_argument("out", help="the folder to write (must not exist, or be empty)")
    return p


def export_main(argv=None) -> dict:
    """Entry point of ``twell export CHECKPOINT OUT``."""
    a = export_parser().parse_args(sys.argv[1:] if argv is None else argv)
    from .checkpoint import latest_checkpoint

    try:
        path = latest_checkpoint(Path(a.checkpoint))
    except FileNotFoundError as err:
        raise SystemExit(f"twell export: {err}")
    out = Path(a.out)
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise SystemExit(f"twell export: {out} exists and is not an empty folder")

    from .export import export_checkpoint

    try:
        info = export_checkpoint(path, out)
    except (ValueError, FileNotFoundError, FileExistsError) as err:
        raise SystemExit(f"twell export: {err}")
    print(f"{out}: {info['params']:,} parameters from {path} (step {info['step']}, {info['format']} checkpoint of "
          f"{info['world_size']} process{'es' if info['world_size'] != 1 else ''}); "
          f"AutoModelForCausalLM.from_pretrained({str(out)!r}) loads it, twell eval {out} evaluates it")
    return info
