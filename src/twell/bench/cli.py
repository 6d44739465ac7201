"""``twell bench``: benchmark twell's kernels against dense PyTorch on this GPU.

    twell bench inference [--out DIR] [--quick] [--variants] [--no-grid]
    twell bench batch [--out DIR] [--quick] [--shape 2048x5632]
    twell bench decode [--out DIR] [--fused] [--shape 2048x5632]
    twell bench model [--out DIR] [--preset 2b] [--k 29] [--batch 16] [--model RUN_OR_CHECKPOINT]
    twell bench training [--out DIR] [--quick] [--variants] [--no-grid]
    twell bench compiled [--out DIR] [--quick] [--no-grid] [--no-model] [--preset 2b] [--layers 16]

``inference`` times the inference FFN (the grid: d 2048, f 5632, bf16,
M in {16384, 131072}, k in {8, ..., 5632}, three unit distributions, plus d 4096, f 11008) and
writes ``inference_mlp_<gpu>.json`` (flat records), the same as CSV, and a PNG plot of speedup
against k (dense = 1) into ``--out``. ``--variants`` also times the design variants (gate
kernels, up/down tuning) into ``inference_variants_<gpu>.json``.

``batch`` times the module as users run it (default settings) at every batch size from one token
to 131072, eager and in CUDA graphs, with host time and peak memory, and a compiled stack
against a compiled dense one: ``inference_batch_<gpu>.{json,csv,png}``. ``--shape 4096x11008``
runs the same grid at another width (no compiled stacks): ``inference_batch_<gpu>_d4096.*``.

``decode`` times small batches in CUDA graphs (M 1 to 256, k 8/29/56, even and skewed units):
``decode_<gpu>.{json,csv,png}``; with ``--fused``, the split decode kernels off
(``twell.inference.dispatch.DECODE_SPLIT``): ``decode_<gpu>_fused.*``; with ``--shape``, at another width:
``decode_<gpu>_d<D>.*``.

``model`` builds a randomly initialised model of a preset's shape, gives its MLPs about ``--k``
active units per token by construction (:func:`twell.bench.model.calibrate_sparsity`), and
measures dense and twell on the same weights: prefill of ``--batch`` x 2048 tokens (Hugging
Face's default path and a lean compiled one), greedy decoding at batch 1 and 16, a training step,
peak memory and energy per token: ``model_<gpu>.{json,csv,png}``. With ``--model`` it loads a
trained model instead (its own sparsity, ``sparsity_source`` "trained") and runs it on windows of
its run's validation split; records of other models already in the JSON are kept.

``training`` times the gated FFN's forward + backward, dense PyTorch against twell's sparse
training kernels (M 1024 to 65536, k 8 to 280, three distributions), eager and compiled, with
every gradient's error and the bytes saved for backward, then training steps of the 0.5b preset
with constructed sparsity on dense and on sparse kernels, eager and with each decoder layer
compiled: ``training_mlp_<gpu>.{json,csv,png}``.

``compiled`` measures twell under ``torch.compile`` as users run it (:mod:`twell.bench.compiled`):
the batch grid (1 to 131072 tokens, k 29 and 280, even and heavy rows) eager, in CUDA graphs,
compiled and compiled with ``mode="reduce-overhead"``, with the path each took; then a model of
``--layers`` decoder layers of ``--preset``'s shape, dense, twell with default settings and twell
with statistics off, eager and compiled: prefill time, peak memory, and greedy ``generate`` at
batch 1 with a static cache and a compiled forward: ``compiled_<gpu>.{json,png}``.

``fp8`` times dense bf16, dense FP8 (rowwise ``torch._scaled_mm``), twell bf16 and twell on FP8
weights side by side (:mod:`twell.bench.fp8`), eager and in CUDA graphs, with each FP8 variant's
worst-row error: ``fp8_<gpu>.{json,png}``.
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import sys
import time
from typing import Optional

__all__ = ["bench_main", "write_results", "plot_speedup"]

KS = (8, 16, 29, 56, 128, 280, 1000, 5632)


def _gpu_tag() -> str:
    import torch

    name = torch.cuda.get_device_name().lower() if torch.cuda.is_available() else "cpu"
    for tag in ("h200", "h100", "a100", "l40", "4090"):
        if tag in name:
            return tag
    return "".join(c if c.isalnum() else "_" for c in name)


def write_results(records: list[dict], path_json: str) -> None:
    """Write ``records`` as JSON and, next to it, as CSV (union of keys, in first-seen order)."""
    with open(path_json, "w") as fh:
        json.dump(records, fh, indent=1)
    keys: list[str] = []
    for r in records:
        keys += [k for k in r if k not in keys]
    with open(os.path.splitext(path_json)[0] + ".csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=keys)
        w.writeheader()
        # lists (the timing rounds) as space-separated numbers in one cell
        w.writerows({k: " ".join(f"{x:.4g}" for x in v) if isinstance(v, list) else v for k, v in r.items()} for r in records)


def plot_speedup(records: list[dict], path_png: str) -> None:
    """Speedup against k (log scale), one line per (shape, M, distribution); dense = 1."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(13, 5), sharey=True)
    groups: dict = {}
    for r in records:
        groups.setdefault((r["d"], r["f"], r["M"], r["distribution"]), []).append(r)
    for ax, field, title in ((axes[0], "speedup", "twell module (auto: kernels or dense)"), (axes[1], "kernels_speedup", "TwELL kernels forced")):
        _speedup_panel(ax, groups, field, title, lambda key: "d={} f={} M={} {}".format(*key))
    axes[0].set_ylabel("speedup over dense bf16 PyTorch (dense = 1)")
    axes[0].legend(fontsize=6)
    gpu = records[0].get("gpu", "") if records else ""
    fig.suptitle(f"TwELL inference FFN, bf16, {gpu}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


def _speedup_panel(ax, groups: dict, field: str, title: str, label) -> None:
    """One log-log panel of ``field`` against k: a line per group of records (``groups``: key ->
    records, the key's last element the distribution, which sets the line style), labelled
    ``label(key)``; lines at 1 (dense) and a grid."""
    styles = {"even": "-", "skewed": "--", "heavy": ":"}
    for key, rs in sorted(groups.items()):
        rs = sorted((r for r in rs if r.get(field) is not None), key=lambda r: r["k"])
        if rs:
            ax.plot([r["k"] for r in rs], [r[field] for r in rs], styles.get(key[-1], "-"), marker="o", ms=3,
                    label=label(key))
    ax.axhline(1.0, color="k", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("k: mean active units per token")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", alpha=0.3)


def _table(records: list[dict]) -> str:
    lines = [f"{'M':>7} {'d':>5} {'f':>6} {'k':>5} {'dist':7} {'dense':>7} {'twell':>7} {'x':>5} {'kern':>7} {'kx':>5} "
             f"{'g+p':>6} {'ud':>7} {'err':>8} {'row':>8} {'drow':>8} {'pub x':>6}"]
    for r in records:
        lines.append(
            f"{r['M']:>7} {r['d']:>5} {r['f']:>6} {r['k']:>5g} {r['distribution']:7} {r['dense_ms']:7.2f} {r['twell_ms']:7.2f} "
            f"{r['speedup']:5.2f} {r.get('kernels_ms', float('nan')):7.2f} {r.get('kernels_speedup', float('nan')):5.2f} "
            f"{r.get('gate_pack_ms', float('nan')):6.2f} {r.get('updown_ms', float('nan')):7.2f} {r['rel_err']:8.1e} "
            f"{r['max_row_err']:8.1e} {r['dense_max_row_err']:8.1e} "
            + (f"{r['published_speedup']:6.2f}" if "published_speedup" in r else f"{'':6}")
        )
    return "\n".join(lines)


def bench_main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="twell bench", description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["inference", "batch", "decode", "model", "training", "compiled", "fp8"], help="which benchmark")
    parser.add_argument("--out", default="benchmarks/results", help="folder for the result files")
    parser.add_argument("--quick", action="store_true", help="a small grid (M 16384, k 29/56/280, even)")
    parser.add_argument("--variants", action="store_true", help="also time the design variants")
    parser.add_argument("--no-grid", action="store_true", help="skip the main grid (training: the train steps "
                        "only, the results file keeps its grid; compiled: the model only)")
    parser.add_argument("--rep", type=int, default=100, help="do_bench repetition budget in ms (the training grid instead times 40 calls of each variant in turn)")
    parser.add_argument("--M", type=int, nargs="+", help="inference: only these tokens per call (d 2048 rows of the "
                        "grid; a check, not a results file: written as inference_mlp_<gpu>_M.json); batch: "
                        "these tokens per call instead of 1 to 131072; training: these tokens per call (the results file keeps "
                        "its records of the others)")
    parser.add_argument("--preset", help="model: the preset whose shape is built (default 2b; with --model, the "
                        "run's own preset labels it); training: the train steps' preset (default 0.5b)")
    parser.add_argument("--k", type=float, default=29, help="model: active units per token to construct (default 29)")
    parser.add_argument("--batch", type=int, default=16, help="model: sequences of 2048 tokens per forward (default 16)")
    parser.add_argument("--no-lean", action="store_true", help="model: skip the compiled lean path")
    parser.add_argument("--no-model", action="store_true", help="compiled, fp8: skip the whole model")
    parser.add_argument("--no-steps", action="store_true", help="training: skip the whole-model train steps "
                        "(the results file keeps those it holds)")
    parser.add_argument("--timed-choice", action="store_true", help="training: the grid with each layer timing its "
                        "two paths near the token floor (twell.training.path_timing.TIMED_CHOICE, off by default), "
                        "written as training_timed_choice_<gpu>.json (no train steps)")
    parser.add_argument("--layers", type=int, default=16, help="compiled: decoder layers of the model (default 16)")
    parser.add_argument("--fused", action="store_true", help="decode: with the split decode kernels off, the "
                        "fused kernel up to 64 tokens (twell.inference.dispatch.DECODE_SPLIT; results written as "
                        "decode_<gpu>_fused.json)")
    parser.add_argument("--shape", default="2048x5632", help="batch, decode: the MLP's width and units, DxF "
                        "(default 2048x5632; another shape writes its results with a _d<D> suffix, and batch "
                        "then skips the compiled stacks, which have d 2048)")
    parser.add_argument("--model", help="model: a trained model instead (a twell checkpoint, run folder or export), "
                        "benchmarked on windows of its run's validation split; --preset then only labels it")
    args = parser.parse_args(argv)
    args.shape = parse_shape(args.shape)  # (d, f); a bad shape says so before any GPU work

    import torch

    if not torch.cuda.is_available():
        raise SystemExit("twell bench needs a CUDA GPU")
    from ..kernels import gate_pack, updown
    from ..inference.dispatch import LayerState as _KernelPath
    from .inference import add_published, best_config, break_even_density, run_grid, run_variants

    os.makedirs(args.out, exist_ok=True)
    tag = _gpu_tag()
    log = lambda s: print(s, flush=True)  # noqa: E731
    t0 = time.time()
    if args.what == "model":
        _model_bench(args, tag, log, t0)
        return
    if args.what == "training":
        _training_bench(args, tag, log, t0)
        return
    if args.what in ("batch", "decode"):
        _runtime_bench(args, tag, log, t0)
        return
    if args.what == "compiled":
        _compiled_bench(args, tag, log, t0)
        return
    if args.what == "fp8":
        _fp8_bench(args, tag, log, t0)
        return
    if args.variants:
        var = run_variants(log=log)
        with open(os.path.join(args.out, f"inference_variants_{tag}.json"), "w") as fh:
            json.dump(var, fh, indent=1)
        best_pack = best_config(var, "pack_bits")
        if best_pack is not None:
            gate_pack.PACK_BITS_CONFIG = best_pack
        # the fused kernel's shape at d 2048, chosen at k 29 (updown.WIDE_STEP lists none above
        # it); the variants time it at a batch where gated calls now take the split path, and it
        # serves the smaller ones, where it was not timed
        best_token = best_config(var, "updown_token", ks=(29,))
        if best_token is not None:
            updown.TUNED[2048] = best_token
        density = break_even_density(var)
        if density is not None:
            _KernelPath.DEFAULT_MAX_DENSITY = round(density, 4)
            # this GPU's own measure (at d 2048), not capped there; widths with their own cap
            # (LayerState.MAX_UNITS_BY_D) keep it
            _KernelPath.DEFAULT_MAX_UNITS = float("inf")
        log(f"variants done in {time.time() - t0:.0f}s; pack {best_pack}; token {best_token}; kernel_max_density {density}")
    if args.no_grid:
        return
    path = os.path.join(args.out, f"inference_mlp_{tag}{'_M' if args.M else ''}.json")
    partial = os.path.splitext(path)[0] + ".partial.jsonl"
    if os.path.exists(partial):
        os.remove(partial)
    kw = dict(rep=args.rep, log=log, partial_path=partial)
    big_ok = lambda M, f, k: k <= 0.06 * f or M <= 16384  # noqa: E731  (forced kernels take seconds when dense)
    if args.quick:
        records = run_grid([(2048, 5632)], [16384], (29, 56, 280), ["even"], **kw)
    elif args.M:
        records = run_grid([(2048, 5632)], args.M, KS, ["even", "skewed", "heavy"], kernel_k_limit=big_ok, **kw)
    else:
        records = run_grid([(2048, 5632)], [4096, 16384, 131072], KS, ["even", "skewed", "heavy"], kernel_k_limit=big_ok, **kw)
        # d 4096 from 4096 tokens, where its gated calls start taking the split up/down
        records += run_grid([(4096, 11008)], [4096, 16384, 65536], (29, 56, 280, 1000), ["even"], kernel_k_limit=big_ok, **kw)
    add_published(records)  # the published kernels' figures, reference constants (not rerun)
    write_results(records, path)
    os.remove(partial)
    plot_speedup(records, os.path.splitext(path)[0] + ".png")
    log(f"grid done in {time.time() - t0:.0f}s; wrote {path}")
    log(_table(records))


def _compiled_bench(args, tag: str, log, t0: float) -> None:
    """``twell bench compiled``: compiled_<gpu>.{json,png}. A part skipped (``--no-grid``,
    ``--no-model``) keeps what the file already holds for it."""
    from .compiled import compiled_grid, compiled_model

    path = os.path.join(args.out, f"compiled_{tag}.json")
    res = {"records": [], "model": []}
    if os.path.exists(path):
        with open(path) as fh:
            res.update(json.load(fh))
    if not args.no_grid:
        Ms = args.M or ((1, 64, 4096) if args.quick else None)
        res["records"] = compiled_grid(log=log, **({"Ms": Ms} if Ms else {}))
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
        plot_batch(res["records"], os.path.splitext(path)[0] + ".png", "M",
                   ("eager_speedup", "compiled_speedup", "compiled_graph_speedup"), "tokens per call M",
                   titles={"eager_speedup": "eager", "compiled_speedup": "torch.compile (default mode)",
                           "compiled_graph_speedup": 'torch.compile(mode="reduce-overhead")'})
    if not args.no_model:
        res["model"] = compiled_model(args.preset or "2b", layers=args.layers, k=args.k, batch=args.batch, log=log)
        with open(path, "w") as fh:
            json.dump(res, fh, indent=1)
    log(f"done in {time.time() - t0:.0f}s; wrote {path}")
    for r in res["records"]:
        log(f"M={r['M']:6d} k={r['k']:3d} {r['distribution']:6s} eager {r['eager_speedup']:.2f}x "
            f"compiled {r['compiled_speedup']:.2f}x ({r['compiled_path']}) reduce-overhead "
            f"{r['compiled_graph_speedup']:.2f}x ({r['compiled_graph_path']}) graph {r['graph_speedup']:.2f}x")
    for r in res["model"]:
        log(f"{r['variant']:16s} {r['mode']:8s} prefill {r['prefill_ms']:.1f} ms ({r['prefill_speedup']:.3f}x) "
            f"peak {r['peak_vs_dense']:.3f} of dense"
            + (f" generate b1 {r['generate_speedup_b1']:.2f}x tokens equal {r['tokens_match']}" if "generate_speedup_b1" in r else ""))


def _fp8_bench(args, tag: str, log, t0: float) -> None:
    """``twell bench fp8``: fp8_<gpu>.{json,png}."""
    from .fp8 import MS, fp8_grid, fp8_model

    Ms = args.M or ((1, 4096, 131072) if args.quick else MS)
    records = fp8_grid(Ms=Ms, log=log)
    path = os.path.join(args.out, f"fp8_{tag}.json")
    with open(path, "w") as fh:
        json.dump({"records": records, "model": []}, fh, indent=1)
    model = [] if args.no_model else fp8_model(args.preset or "2b", k=args.k, batch=args.batch, log=log)
    with open(path, "w") as fh:
        json.dump({"records": records, "model": model}, fh, indent=1)
    for r in model:
        log(f"model {r['preset']} {r['variant']:10s} prefill {r['prefill_ms']:.1f} ms: {r['prefill_speedup']:.3f}x dense bf16, "
            f"{r['fp8_speedup']:.3f}x dense fp8")
    plot_batch([r for r in records if r["mode"] == "graph"], os.path.splitext(path)[0] + ".png", "M", ("fp8_vs_dense_fp8_speedup", "fp8_vs_dense_bf16_speedup", "bf16_vs_dense_bf16_speedup"),
               "tokens per call M", titles={"fp8_vs_dense_fp8_speedup": "twell FP8 over dense FP8",
                                            "fp8_vs_dense_bf16_speedup": "twell FP8 over dense bf16",
                                            "bf16_vs_dense_bf16_speedup": "twell bf16 over dense bf16"})
    log(f"done in {time.time() - t0:.0f}s; wrote {path}")


def _model_bench(args, tag: str, log, t0: float) -> None:
    """``twell bench model``: model_<gpu>.{json,csv,png}; its decode records also go to the
    ``model`` list of decode_<gpu>.json."""
    from .model import bench_model

    model_path, tokens, preset = None, None, args.preset or "2b"
    if args.model:
        model_path, tokens, run_preset = _trained_model(args.model)
        preset = args.preset or run_preset or "model"
    res = bench_model(preset, args.k, args.batch, lean=not args.no_lean, log=log, model_path=model_path,
                      tokens=tokens)
    path = os.path.join(args.out, f"model_{tag}.json")
    merged = merge_model_results(path, res, preset)
    with open(path, "w") as fh:
        json.dump(merged, fh, indent=1)
    _write_csv(merged["records"], os.path.splitext(path)[0] + ".csv")
    source = res["records"][0]["sparsity_source"]
    same = lambda r: (r.get("preset"), r.get("sparsity_source", "calibrated")) == (preset, source)  # noqa: E731
    decode_path = os.path.join(args.out, f"decode_{tag}.json")
    if os.path.exists(decode_path):
        with open(decode_path) as fh:
            dec = json.load(fh)
        dec["model"] = [r for r in dec.get("model", []) if not same(r)] + res["decode"]
        with open(decode_path, "w") as fh:
            json.dump(dec, fh, indent=1)
    plot_model(res["records"], os.path.splitext(path)[0] + ".png")
    dense, twell = res["records"]  # the variants of this run
    rows = [("prefill, HF default", "prefill_tok_per_ms"), ("prefill, lean", "prefill_lean_tok_per_ms"),
            ("decode b1, HF default", "decode_tok_per_s_b1"), ("decode b16, HF default", "decode_tok_per_s_b16"),
            ("decode b1, lean", "decode_lean_tok_per_s_b1"), ("decode b16, lean", "decode_lean_tok_per_s_b16"),
            ("train step", "train_tok_per_s"), ("train step, compiled", "train_compiled_tok_per_s")]
    log(f"\n{'':22s} {'dense':>10s} {'twell':>10s} {'ratio':>7s}")
    for name, key in rows:
        if dense.get(key) and twell.get(key):
            log(f"{name:22s} {dense[key]:10.1f} {twell[key]:10.1f} {twell[key] / dense[key]:6.3f}x")
    for name, key in (("mJ/token, HF default", "mj_per_token"), ("mJ/token, lean", "mj_per_token_lean"),
                      ("peak GiB, prefill", "peak_bytes"), ("peak GiB, lean", "peak_bytes_lean")):
        if dense.get(key) and twell.get(key):
            scale = 2**30 if "bytes" in key else 1
            log(f"{name:22s} {dense[key] / scale:10.3f} {twell[key] / scale:10.3f} {twell[key] / dense[key]:6.3f}x")
    log(f"done in {time.time() - t0:.0f}s; wrote {path}")


def merge_model_results(path: str, res: dict, preset: str) -> dict:
    """The content of model_<gpu>.json after a ``twell bench model`` run of ``preset``: this run's
    records, decode records and sparsity replace those of the same (preset, sparsity source);
    those of other models and the trained model's section are kept. Files of older versions
    (one ``sparsity`` entry, or ``sparsity_by_source``) are read too."""
    old = {}
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
    source = res["records"][0]["sparsity_source"]
    same = lambda r: (r.get("preset"), r.get("sparsity_source", "calibrated")) == (preset, source)  # noqa: E731
    sparsity = dict(old.get("sparsity_by_model", {}))
    if "sparsity" in old:  # the first version: the calibrated model's construction only
        calibrated = {r.get("preset") for r in old.get("records", []) if r.get("sparsity_source", "calibrated") == "calibrated"}
        sparsity.setdefault(f"{min(calibrated) if calibrated else '2b'} calibrated", old["sparsity"])
    for src, value in old.get("sparsity_by_source", {}).items():  # the second: keyed by source only
        presets = {r.get("preset") for r in old.get("records", []) if r.get("sparsity_source", "calibrated") == src}
        sparsity.setdefault(f"{min(presets) if presets else '?'} {src}", value)
    sparsity[f"{preset} {source}"] = res["sparsity"]
    return {"records": [r for r in old.get("records", []) if not same(r)] + res["records"],
            "trained": old.get("trained"),
            "decode": [r for r in old.get("decode", []) if not same(r)] + res["decode"],
            "sparsity_by_model": sparsity}


def _training_bench(args, tag: str, log, t0: float) -> None:
    """``twell bench training``: training_mlp_<gpu>.{json,csv,png} (with ``--timed-choice``:
    training_timed_choice_<gpu>.{json,csv,png}, the grid alone)."""
    from .training import run_training_grid, train_step_records, tune_configs

    timed = args.timed_choice
    if timed:
        from ..training import path_timing

        path_timing.TIMED_CHOICE = True
        args.no_steps = True  # the train steps are timed with the defaults only
    path = os.path.join(args.out, f"training_{'timed_choice' if timed else 'mlp'}_{tag}.json")
    partial = os.path.splitext(path)[0] + ".partial.jsonl"
    if os.path.exists(partial):
        os.remove(partial)
    tuning = None
    if args.variants:
        tuning = tune_configs(log=log)
        with open(os.path.join(args.out, f"training_tuning_{tag}.json"), "w") as fh:
            json.dump(tuning, fh, indent=1)
    old = {}
    if os.path.exists(path):
        with open(path) as fh:
            old = json.load(fh)
    if args.no_grid and args.no_steps:
        return
    if args.no_grid:  # the train steps only: the file keeps its grid
        records = old.get("records", [])
    elif args.quick:
        records = run_training_grid(Ms=tuple(args.M or (16384,)), ks=(8, 29, 56, 280), distributions=("even", "heavy"),
                                    log=log, partial_path=partial)
    else:
        records = run_training_grid(**({"Ms": tuple(args.M)} if args.M else {}), log=log, partial_path=partial)
    if args.M and not args.no_grid:  # a part of the grid: the file keeps its records of the other token counts
        key = lambda r: (r["M"], r["k"], r["distribution"])  # noqa: E731
        new_keys = {key(r) for r in records}
        records = sorted([r for r in old.get("records", []) if key(r) not in new_keys] + records,
                         key=lambda r: (r["M"], r["distribution"], r["k"]))
    steps = old.get("train_step", []) if args.no_steps else train_step_records(args.preset or "0.5b", k=args.k, log=log)
    with open(path, "w") as fh:
        doc = {"records": records, "train_step": steps, "tuning": tuning or old.get("tuning")}
        if timed:
            doc["timed_choice"] = True
        json.dump(doc, fh, indent=1)
    if os.path.exists(partial):
        os.remove(partial)
    _write_csv(records, os.path.splitext(path)[0] + ".csv")
    plot_training(records, steps, os.path.splitext(path)[0] + ".png")
    log(f"\n{'M':>6} {'k':>5} {'dist':7} {'dense':>7} {'sparse':>7} {'x':>5} {'dpath':>7} {'x':>5} {'twell':>7} {'x':>5} "
        f"{'path':>6} {'gap':>6} {'grad err':>8} {'row':>8} {'drow':>8} {'saved MiB':>12}")
    for r in records:
        log(f"{r['M']:>6} {r['k']:>5} {r['distribution']:7} {r['dense_ms']:7.2f} {r['sparse_ms']:7.2f} "
            f"{r['sparse_speedup']:5.2f} {r['dense_path_ms']:7.2f} {r['dense_path_speedup']:5.2f} {r['twell_ms']:7.2f} "
            f"{r['speedup']:5.2f} {str(r['twell_path']):>6} {_gap(r):>6} {max(r['grad_rel_err'].values()):8.1e} "
            f"{r['max_row_err']:8.1e} {r['dense_max_row_err']:8.1e} {r['saved_bytes'] / 2**20:5.0f}/{r['dense_saved_bytes'] / 2**20:<6.0f}")
    for st in steps:
        dn = next(s for s in steps if s["kernels"] == "dense" and s.get("lr") == st.get("lr"))
        log(f"train step {st['preset']} lr {st.get('lr', 3e-4):g} {st['kernels']:>11}: {st['tokens_per_s']:.0f} tokens/s "
            f"({st['tokens_per_s'] / dn['tokens_per_s']:.3f}x dense), peak {st['peak_bytes'] / 2**30:.1f} GiB, "
            f"final loss {st['losses'][-1]:.4f}, paths {st['paths']}")
    log(f"done in {time.time() - t0:.0f}s; wrote {path}")


def _gap(record: dict) -> str:
    """How far "auto" is from the faster of the module's two forced paths (records made before
    those were timed: the bare ops' gap, in parentheses)."""
    if "module_auto_gap" in record:
        return f"{record['module_auto_gap']:+.3f}"
    return f"({record['auto_gap']:+.2f})" if "auto_gap" in record else "-"


def plot_training(records: list[dict], steps: list[dict], path_png: str) -> None:
    """Forward + backward speedup against k (one line per M and distribution) of the module with
    default settings and of the sparse kernels forced, and the train steps' loss curves."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(18, 5))
    groups: dict = {}
    for r in records:
        groups.setdefault((r["M"], r["distribution"]), []).append(r)
    panels = (("speedup", "SparseGatedMLP, default settings (train_kernels auto)"),
              ("sparse_speedup", "sparse training kernels forced"))
    for ax, (field, title) in zip(axes[:2], panels):
        _speedup_panel(ax, groups, field, f"{title} (d 2048, f 5632)", lambda key: "M={} {}".format(*key))
        ax.set_ylabel("forward + backward speedup over dense bf16 PyTorch")
        ax.legend(fontsize=7)
    for s in steps:
        axes[2].plot(range(1, len(s["losses"]) + 1), s["losses"], ls="-" if s["kernels"] == "dense" else "--",
                     label=f"{s['kernels']}{' compiled' if s.get('compile') else ''}, lr {s.get('lr', 3e-4):g}: "
                           f"{s['tokens_per_s']:.0f} tok/s")
    axes[2].set_xlabel("step (the warm-up steps first)")
    axes[2].set_ylabel("cross entropy")
    axes[2].set_title(f"{steps[0]['preset'] if steps else ''} train steps, same weights and batches", fontsize=10)
    axes[2].legend(fontsize=8)
    gpu = records[0].get("gpu", "") if records else ""
    fig.suptitle(f"twell training FFN, bf16, {gpu}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


def _trained_model(spec: str):
    """``(checkpoint folder, validation token stream or None, the run's preset or None)`` for
    ``--model``: a run folder means
    its newest checkpoint; the stream is the run's validation split when the folder names its
    run's settings (train_config.json), as ``twell eval`` reads it."""
    import numpy as np
    import torch

    from ..recipe.checkpoint import model_folder, run_settings, run_tokenizer
    from ..recipe.config import TrainConfig
    from ..recipe.corpus import load_corpus
    from ..recipe.data import load_tokenizer

    path = model_folder(spec, "twell bench model")
    saved = run_settings(path)
    if not saved:
        return str(path), None, None
    cfg = TrainConfig(**{k: v for k, v in saved.items() if k in TrainConfig.__dataclass_fields__})
    try:
        tokenizer = load_tokenizer(run_tokenizer(path, cfg.tokenizer))
        _, val = load_corpus(cfg.data, tokenizer, cfg.seq_len or 2048, cfg.seed, cfg.val_fraction, cfg.text_field,
                             cfg.max_docs)
    except (ValueError, FileNotFoundError, ImportError) as err:
        raise SystemExit(f"twell bench model: {err}")
    return str(path), torch.as_tensor(np.asarray(val.tokens[: len(val.tokens)], dtype=np.int64)), saved.get("preset")


def _write_csv(records: list[dict], path: str) -> None:
    keys = list(dict.fromkeys(k for r in records for k in r if not isinstance(r[k], (list, dict))))
    with open(path, "w") as fh:
        fh.write(",".join(keys) + "\n")
        for r in records:
            fh.write(",".join("" if r.get(k) is None else str(r.get(k)) for k in keys) + "\n")


def plot_model(records: list[dict], path_png: str) -> None:
    """Bar chart of twell over dense for each whole-model measure (higher is better)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    dense, twell = records
    items = [("prefill\nHF default", "prefill_tok_per_ms", False), ("prefill\nlean", "prefill_lean_tok_per_ms", False),
             ("decode b1\nHF default", "decode_tok_per_s_b1", False), ("decode b16\nHF default", "decode_tok_per_s_b16", False),
             ("decode b1\nlean", "decode_lean_tok_per_s_b1", False), ("decode b16\nlean", "decode_lean_tok_per_s_b16", False),
             ("train\nstep", "train_tok_per_s", False), ("train step\ncompiled", "train_compiled_tok_per_s", False),
             ("energy\nHF default", "mj_per_token", True),
             ("energy\nlean", "mj_per_token_lean", True), ("peak mem.\nprefill", "peak_bytes", True),
             ("peak mem.\nlean", "peak_bytes_lean", True)]
    names, ratios = [], []
    for name, key, lower_better in items:
        if dense.get(key) and twell.get(key):
            names.append(name)
            ratios.append(dense[key] / twell[key] if lower_better else twell[key] / dense[key])
    fig, ax = plt.subplots(figsize=(13, 3.8))
    bars = ax.bar(names, ratios, color=["tab:green" if r >= 1 else "tab:red" for r in ratios])
    ax.axhline(1.0, color="k", lw=0.8)
    for b, r in zip(bars, ratios):
        ax.text(b.get_x() + b.get_width() / 2, r, f"{r:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("twell advantage over dense (x)")
    ax.set_title(f"{dense['preset']} shape, about {dense['k']:g} active units per token (constructed), {dense['gpu']}",
                 fontsize=9)
    fig.tight_layout()
    fig.savefig(path_png, dpi=120)
    plt.close(fig)


def parse_shape(text: str) -> tuple[int, int]:
    """``"4096x11008"`` -> ``(4096, 11008)``: an MLP's width d and units f."""
    try:
        d, f = (int(v) for v in text.lower().split("x"))
    except ValueError:
        d = f = 0  # not two integers: the same error as a non-positive one
    if d < 1 or f < 1:
        raise SystemExit(f"--shape takes DxF, two positive integers such as 4096x11008; got {text!r}")
    return d, f


def _runtime_bench(args, tag: str, log, t0: float) -> None:
    from .runtime import D, F, batch_grid, compile_compare, decode_grid

    d, f = args.shape
    suffix = "" if (d, f) == (D, F) else f"_d{d}"
    if args.what == "batch":
        Ms = args.M or ((1, 16, 4096) if args.quick else (1, 4, 16, 64, 256, 1024, 4096, 16384, 131072))
        records = batch_grid(Ms=Ms, log=log, d=d, f=f)
        comp = compile_compare(log=log) if not suffix else []
        path = os.path.join(args.out, f"inference_batch_{tag}{suffix}.json")
        with open(path, "w") as fh:
            json.dump({"records": records, "compile": comp}, fh, indent=1)
        write_results(records, os.path.splitext(path)[0] + "_records.json")
        os.remove(os.path.splitext(path)[0] + "_records.json")
        plot_batch(records, os.path.splitext(path)[0] + ".png", "M", ("speedup", "graph_speedup"), "tokens per call M")
    else:
        if args.fused:
            from ..inference import dispatch

            dispatch.DECODE_SPLIT = False
        records = decode_grid(log=log, d=d, f=f)
        path = os.path.join(args.out, f"decode_{tag}{'_fused' if args.fused else ''}{suffix}.json")
        model = []  # the generation records `twell bench model` wrote there stay
        if os.path.exists(path):
            with open(path) as fh:
                model = json.load(fh).get("model", [])
        with open(path, "w") as fh:
            json.dump({"mlp": records, "model": model}, fh, indent=1)
        write_results(records, os.path.splitext(path)[0] + "_mlp.json")
        os.remove(os.path.splitext(path)[0] + "_mlp.json")
        plot_batch(records, os.path.splitext(path)[0] + ".png", "M", ("speedup", "decode_speedup", "speedup_flushed"),
                   "tokens per call M", titles=_DECODE_TITLES)
    log(f"done in {time.time() - t0:.0f}s; wrote {path}")


_DECODE_TITLES = {
    "speedup": "speedup (eight layers back to back in a graph)",
    "decode_speedup": "decode kernels forced (eight layers)",
    "speedup_flushed": "speedup (one layer, L2 zeroed before each replay)",
}


def plot_batch(records: list[dict], path_png: str, xkey: str, fields: tuple[str, ...], xlabel: str,
               titles: Optional[dict] = None) -> None:
    """Speedup over dense against ``xkey`` (log-log), one line per (k, distribution); one panel per
    field, titled by ``titles`` (default: the field's name)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(fields), figsize=(6.5 * len(fields), 4.8), sharey=True)
    groups: dict = {}
    for r in records:
        groups.setdefault((r["k"], r["distribution"]), []).append(r)
    for ax, field in zip(axes, fields):
        for (k, dist), rs in sorted(groups.items()):
            rs = sorted(rs, key=lambda r: r[xkey])
            ax.plot([r[xkey] for r in rs], [r[field] for r in rs], "--" if dist != "even" else "-", marker="o", ms=3, label=f"k={k} {dist}")
        ax.axhline(1.0, color="k", lw=0.8)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel(xlabel)
        ax.set_title((titles or {}).get(field, field.replace("_", " ")), fontsize=10)
        ax.grid(True, which="both", alpha=0.3)
    axes[0].set_ylabel("speedup over the dense PyTorch MLP (dense = 1)")
    axes[0].legend(fontsize=7)
    gpu = records[0].get("gpu", "") if records else ""
    fig.suptitle(f"twell SparseGatedMLP, default settings, d=2048 f=5632 bf16, {gpu}", fontsize=11)
    fig.tight_layout()
    fig.savefig(path_png, dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    bench_main(sys.argv[1:])
