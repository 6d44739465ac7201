"""Device experiment: up to how many tokens per call should eager calls replay twell's own CUDA
graphs (``twell.eager_graphs.MAX_M``)? Runs ``twell bench batch``'s records at 128 to 512 tokens
with MAX_M 64 (those sizes run eagerly) and 512 (replayed), alternating twice in one process so
that both settings see the same host phases.

Usage (GPU machine, repository root): OUT=dir python benchmarks/eager_graph_range_probe.py
Writes OUT/eager_graph_range_probe.json.
"""

from __future__ import annotations

import json
import os

import twell.eager_graphs as EG
from twell.bench.runtime import batch_grid

OUT = os.environ.get("OUT", ".")
runs = []
for rnd in range(2):
    for max_m in (64, 512):
        EG.MAX_M = max_m
        recs = batch_grid(Ms=(128, 256, 512), ks=(29, 280), dists=("even",),
                          log=lambda s, m=max_m: print(f"MAX_M {m}: {s}", flush=True))
        runs.append({"round": rnd, "max_m": max_m, "records": recs})
with open(os.path.join(OUT, "eager_graph_range_probe.json"), "w") as fh:
    json.dump(runs, fh, indent=1)
print("\nM    k   eager speedup with MAX_M 64 | 512 (two rounds)")
for M in (128, 256, 512):
    for k in (29, 280):
        cells = []
        for run in runs:
            r = next(r for r in run["records"] if r["M"] == M and r["k"] == k)
            cells.append(f"{run['max_m']}:{r['speedup']:.3f}{'*' if r['eager_graph'] else ''}")
        print(M, k, " ".join(cells))
