"""Data for the training path's "auto" rule (``twell.train_path.use_sparse``): where the sparse
training op beats the dense one, by tokens per call M, mean active units k, and heavy rows.

Written when the rule read only the layer's mean of active units per token (sparse at most
``MAX_DENSITY * f``, 34 of 5632) and the share of rows above the ELL width that mean gives (at
most ``HEAVY_SHARE_MAX``), for two questions the grid of ``twell bench training`` (M 16384 and
65536 only) could not answer:

- small calls: does the sparse op still win at 2048 to 8192 tokens per call (a fine-tuning
  micro-batch), where its fixed costs (63 CUDA launches, the host's Python) weigh more? (It
  does not: ``twell.train_path.MIN_SPARSE_TOKENS`` came from this probe.)
- heavy-tailed layers: a few rows with hundreds of units raise the mean past the cutoff while
  the ELL rows stay light (the synthetic "heavy" layers at k 56: the sparse op 1.64x, but
  "auto" trains them dense at 1.01x).

Forward + backward of the gated FFN (bf16, d 2048, f 5632), timed call by call in turn
(``twell.bench.timing.interleaved_ms``): dense PyTorch (no L1 term), twell's dense op, the
module with default settings (``module_ms``, ``module_path``) and the sparse op (all three with
the L1 term), the latter at the width "auto" would give (from the mean) and,
for heavy-tailed layers, at other widths. Each record has the row counts' mean, max, the share of
rows above the width and the ELL rows' entries per token (the light rows' units over M). Each
variant is timed in turn with dense PyTorch alone. ``--steps`` adds whole training steps of the
0.5b preset at 1, 2 and 4 x 2048 tokens (``twell.bench.training.train_step_records``, lr 0).

    python benchmarks/train_auto_rule_probe.py [OUTDIR] [--quick] [--steps] [--small]

``--small`` instead times one layer with default settings against dense PyTorch at 1 to 4096
tokens per call, with each call's peak memory (``train_auto_rule_probe_small.json``).

Writes OUTDIR/train_auto_rule_probe.json; prints one line per case.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch

from heavy_share_probe import tensors as mixture  # light k 29 rows, a share p with ~600 units (benchmarks/ is on the path)
from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.timing import interleaved_ms
from twell.bench.training import LAM, _dense_fn, _module_fn, _sparse_fn
from twell.train_ops import choose_width, dense_gated_ffn

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
OUT = ARGS[0] if ARGS else os.environ.get("OUT", "/tmp")
QUICK = "--quick" in sys.argv
D, F = 2048, 5632


def synthetic(M: int, k: float, dist: str):
    s = make_ffn(M, D, F, k, dist, device="cuda")
    return [s.x, s.w_gate, s.w_up, s.w_down]


def case(name: str, M: int, tensors, widths_extra=(), calls: int = 20) -> dict:
    x, wg, wu, wd = (t.detach().requires_grad_(True) for t in tensors)
    dy = torch.randn_like(x) / math.sqrt(D)
    with torch.no_grad():
        counts = (torch.mm(x, wg.t()) > 0).sum(1).float()
    mean = float(counts.mean())
    w_auto = choose_width(mean, None, F)
    widths = [w_auto] + [w for w in widths_extra if w != w_auto]
    lam = torch.full((), LAM, device="cuda")

    def dense_op():
        out = dense_gated_ffn(x, wg, wu, wd)
        return torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam))

    module, m = _module_fn(x, wg, wu, wd, dy)
    dense = _dense_fn(x, wg, wu, wd, dy)
    t0 = time.time()

    def vs_dense(fn) -> tuple:
        # each variant timed in turn with dense alone: a sparse call timed right after another
        # sparse call reads slower (benchmarks/NOTES_training.md, seventeenth session)
        d_ms, v_ms = interleaved_ms([dense, fn], calls=calls, warmup=2)
        return d_ms, v_ms

    rec = dict(case=name, M=M, k_mean=mean, k_max=float(counts.max()), sparse=[])
    rec["dense_ms"], rec["dense_op_ms"] = vs_dense(dense_op)
    rec["dense_ms_module"], rec["module_ms"] = vs_dense(module)
    rec["module_path"] = m.last_train_path
    for w in widths:
        d_ms, t = vs_dense(_sparse_fn(x, wg, wu, wd, dy, w))
        light = counts <= w
        rec["sparse"].append(dict(width=w, ms=t, dense_ms=d_ms, speedup=d_ms / t, heavy_share=float((~light).float().mean()),
                                  light_per_token=float((counts * light).sum()) / M, auto_width=w == w_auto))
    ms = [rec["dense_ms"], rec["dense_op_ms"], rec["module_ms"]]
    s = " ".join(f"W{r['width']} {r['ms']:.3f} ({r['speedup']:.2f}x, share {r['heavy_share']:.3f}, light {r['light_per_token']:.1f})"
                 for r in rec["sparse"])
    print(f"{name:22s} M {M:6d} mean {mean:6.1f} max {rec['k_max']:5.0f} dense {ms[0]:.3f} dense op {ms[1]:.3f} module {ms[2]:.3f} ({rec['module_path']}, {rec['dense_ms_module'] / ms[2]:.2f}x) | {s} [{time.time() - t0:.0f}s]",
          flush=True)
    return rec


def peak_mib(fn) -> float:
    """Memory one call allocates at its peak above what was live before it, MiB."""
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    fn()
    torch.cuda.synchronize()
    return (torch.cuda.max_memory_allocated() - base) / 2**20


def small_calls() -> list:
    """One layer (k 29 even) at 1 to 4096 tokens per call: the module with default settings
    against dense PyTorch, time (in turn) and peak memory of a call."""
    out = []
    for M in (1, 16, 256, 1024, 2048, 4096):
        x, wg, wu, wd = (t.detach().requires_grad_(True) for t in synthetic(max(M, 64), 29, "even"))
        x = x[:M].detach().requires_grad_(True)
        dy = torch.randn_like(x) / math.sqrt(D)
        module, m = _module_fn(x, wg, wu, wd, dy)
        dense = _dense_fn(x, wg, wu, wd, dy)
        d_ms, m_ms = interleaved_ms([dense, module], calls=50, warmup=3)
        rec = dict(M=M, dense_ms=d_ms, module_ms=m_ms, speedup=d_ms / m_ms, module_path=m.last_train_path,
                   dense_peak_mib=peak_mib(dense), module_peak_mib=peak_mib(module))
        out.append(rec)
        print(f"small M {M:5d} dense {d_ms:.3f} module {m_ms:.3f} ms ({rec['speedup']:.2f}x, {rec['module_path']}) "
              f"peak {rec['module_peak_mib']:.1f} / {rec['dense_peak_mib']:.1f} MiB", flush=True)
    return out


def main() -> None:
    if "--small" in sys.argv:
        with open(os.path.join(OUT, "train_auto_rule_probe_small.json"), "w") as fh:
            json.dump(dict(machine=machine_info(), small=small_calls()), fh, indent=1)
        return
    records = []
    Ms = (2048, 8192, 16384) if QUICK else (2048, 4096, 8192, 16384, 32768)
    for M in Ms:
        for k in ((8, 29) if QUICK else (8, 29, 40, 48)):
            records.append(case(f"even k{k}", M, synthetic(M, k, "even")))
            torch.cuda.empty_cache()
    for M in ((4096, 16384) if QUICK else (4096, 16384)):
        for k in (29, 40):
            records.append(case(f"skewed k{k}", M, synthetic(M, k, "skewed")))
    for k in ((29, 56) if QUICK else (29, 56, 100, 160)):
        records.append(case(f"heavy k{k}", 16384, synthetic(16384, k, "heavy"), widths_extra=(32, 64, 128)))
    for p in ((0.02, 0.1) if QUICK else (0.01, 0.03, 0.1, 0.2)):
        records.append(case(f"mix k29 p{p}", 16384, mixture(p), widths_extra=(64,)))
    steps = []
    if "--steps" in sys.argv:
        from twell.bench.training import train_step_records

        for batch in (1, 2, 4):
            for r in train_step_records("0.5b", 29, batch=batch, seq=2048, steps=20, lrs=(0.0,), log=lambda s: None):
                r.pop("losses", None)
                steps.append(r)
                print(f"0.5b step {batch} x 2048 {r['kernels']:12s} {r['tokens_per_s'] / 1e3:7.1f}k tokens/s paths {r['paths']}", flush=True)
    with open(os.path.join(OUT, "train_auto_rule_probe.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), records=records, train_step=steps), fh, indent=1)


if __name__ == "__main__":
    main()
