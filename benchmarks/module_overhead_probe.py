"""Device experiment: where the module loses against what it runs, at 16384 and 65536 tokens.

Two readings of the break-even sweeps (NOTES_inference, thirty-third session) this checks:
- d 4096, f 11008, k 112 / 128: the module on its dense branch read 0.94x to 1.05x dense PyTorch
  from run to run, its third round of three always the slowest. Is the dense branch itself
  slower there (``relu_mul_`` at this width), or does the layer flip paths between calls?
- d 2048, f 5632, k 48 / 56: the module on the prefill kernels ran 5 to 9% behind the forced
  kernels. The module passed its estimate to the up/down's shape (four entries a step from
  WIDE_STEP's 40 units, measured at 131072 tokens) where the forced op kept two. WIDE_STEP has
  been empty since (this probe's finding); the variant below puts that entry back.

Times (bf16, units spread evenly, ROUNDS rounds alternating, medians of
``twell.bench.inference.bench_ms``): dense PyTorch, the module in "auto", the module forced to
its dense branch and to its prefill path, and (d 2048) the module in "auto" with WIDE_STEP's
old d 2048 entry, four entries a step from 40 units (the forced prefill path takes no probes,
so it has no estimate and keeps TUNED's shape; the run that found this timed the module with
the entry and with WIDE_STEP emptied);
for each module variant the paths its layer chose over the timed calls.

    python benchmarks/module_overhead_probe.py [OUTDIR]
    CASES=4096x11008x16384x112 python benchmarks/module_overhead_probe.py [OUTDIR]

Writes OUTDIR/module_overhead_probe.json; prints the table last.
"""

from __future__ import annotations

import collections
import json
import os
import statistics
import sys

import torch

from twell import SparseGatedMLP
from twell.bench.inference import bench_ms, dense_gated, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import updown

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
# d x f x M x k, comma-separated (the first run: 4096x11008x16384x112,4096x11008x16384x128,
# 2048x5632x16384x48,2048x5632x16384x56)
CASES = [tuple(int(v) for v in c.split("x")) for c in os.environ.get(
    "CASES", "2048x5632x16384x48,2048x5632x16384x56,2048x5632x65536x48,2048x5632x65536x56").split(",")]
ROUNDS = 6
OLD_WIDE_STEP = (40.0, (4, 4))  # d 2048's entry until the thirty-third session


def module_for(s, d: int, f: int, mode: str) -> SparseGatedMLP:
    mod = SparseGatedMLP(d, f, device="cuda", dtype=torch.bfloat16).eval()
    with torch.no_grad():
        mod.gate_proj.weight.copy_(s.w_gate)
        mod.up_proj.weight.copy_(s.w_up)
        mod.down_proj.weight.copy_(s.w_down)
    mod.track_stats = False
    mod.kernel_mode = mode
    return mod


def main() -> None:
    recs = []
    wide = dict(updown.WIDE_STEP)
    with torch.no_grad():
        for d, f, M, k in CASES:
            s = make_ffn(M, d, f, k, "even", torch.bfloat16, "cuda", seed=M + k + d)
            x = s.x
            mods = {"auto": module_for(s, d, f, "auto"), "dense branch": module_for(s, d, f, "dense"),
                    "prefill": module_for(s, d, f, "prefill")}
            paths = {n: collections.Counter() for n in mods}
            for name, mod in mods.items():
                layer, real = mod._twell_layer, mod._twell_layer.choose

                def counted(*a, _real=real, _c=paths[name], **kw):
                    p = _real(*a, **kw)
                    _c[p] += 1
                    return p

                layer.choose = counted
                for _ in range(3):  # let the layer's estimate arrive
                    mod(x)
                    torch.cuda.synchronize()
            variants = {"dense PyTorch": lambda s=s: dense_gated(s.x, s.w_gate, s.w_up, s.w_down)}
            variants.update({f"module {n}": (lambda m=m, x=s.x: m(x)) for n, m in mods.items()})
            if d == 2048:  # the auto module (its estimate set: the forced paths take no probes)
                def old_wide(m=mods["auto"], x=s.x):
                    updown.WIDE_STEP[2048] = OLD_WIDE_STEP
                    try:
                        return m(x)
                    finally:
                        updown.WIDE_STEP.clear()
                        updown.WIDE_STEP.update(wide)
                variants["module auto, old WIDE_STEP"] = old_wide
            times = {n: [] for n in variants}
            for _ in range(ROUNDS):
                for n, fn in variants.items():
                    times[n].append(bench_ms(fn, rep=60))
            ms = {n: statistics.median(t) for n, t in times.items()}
            rec = dict(d=d, f=f, M=M, k=k, k_est=mods["auto"]._twell_layer.k_est, ms=ms, rounds=times,
                       paths={n: dict(c) for n, c in paths.items()})
            recs.append(rec)
            print(f"d {d} M {M} k {k}: " + ", ".join(f"{n} {v:.3f}" for n, v in ms.items())
                  + f" | paths {rec['paths']}", flush=True)
            for n, t in times.items():
                print(f"    {n:<30} rounds " + " ".join(f"{v:.3f}" for v in t), flush=True)
            del s, x, mods
            torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "module_overhead_probe.json"), "w") as fh:
        json.dump({"machine": machine_info(), "records": recs}, fh, indent=1)
    print("ratio to dense PyTorch (higher is faster):")
    for r in recs:
        base = r["ms"]["dense PyTorch"]
        print(f"d {r['d']} M {r['M']} k {r['k']:<4} " + ", ".join(f"{n} {base / v:.3f}x" for n, v in r["ms"].items()))


if __name__ == "__main__":
    main()
