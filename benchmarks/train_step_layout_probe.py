"""Device experiment: is the 0.5b train step's loss curve at lr 3e-4 moved by the kernels' layout,
or does it stray as much between two runs of the same layout?

`twell bench training`'s lr 3e-4 steps (constructed sparsity that drifts, most rows through the
dense backup at the first steps) run three times: ``train_path.KERNEL_LAYOUT`` off, on, on.
Prints, for the "sparse" and "dense_fused" kernels, the largest loss difference at any step
between the runs, and each run's against the plain dense one.

Usage (GPU machine, repository root): OUT=dir python benchmarks/train_step_layout_probe.py
Writes OUT/train_step_layout_probe.json.
"""

from __future__ import annotations

import json
import os

from twell import train_path
from twell.bench.training import train_step_records

OUT = os.environ.get("OUT", ".")
os.makedirs(OUT, exist_ok=True)
runs = []
for layout in (False, True, True):
    train_path.KERNEL_LAYOUT = layout
    recs = train_step_records("0.5b", lrs=(3e-4,), log=lambda s: None)
    runs.append({"kernel_layout": layout, "losses": {r["kernels"]: r["losses"] for r in recs},
                 "tokens_per_s": {r["kernels"]: r["tokens_per_s"] for r in recs}})
    print(f"layout {layout}: " + ", ".join(f"{k} {v:.0f} tokens/s" for k, v in runs[-1]["tokens_per_s"].items()), flush=True)
with open(os.path.join(OUT, "train_step_layout_probe.json"), "w") as fh:
    json.dump(runs, fh)


def gap(a, b):
    return max(abs(x - y) for x, y in zip(a, b))


for kernels in ("sparse", "dense_fused", "auto"):
    L = [r["losses"][kernels] for r in runs]
    print(f"{kernels}: off vs on {gap(L[0], L[1]):.4f}, on vs on {gap(L[1], L[2]):.4f}, "
          f"against dense: " + " / ".join(f"{gap(l, r['losses']['dense']):.4f}" for l, r in zip(L, runs)))
print("dense: off vs on", f"{gap(runs[0]['losses']['dense'], runs[1]['losses']['dense']):.4f}",
      "on vs on", f"{gap(runs[1]['losses']['dense'], runs[2]['losses']['dense']):.4f}")
