"""Device experiment: which eager calls should replay twell's own CUDA graphs?

- Default: up to how many tokens (``twell.eager_graphs.MAX_M``). ``twell bench batch``'s records
  at 128 to 512 tokens with MAX_M 64 (those sizes run eagerly) and 512 (replayed).
- ``--prefill``: the prefill band (``twell.eager_graphs.PREFILL_BAND``). Records at 4096 and 6144
  tokens with the band off (eager dense) and on (a replayed graph of the prefill kernels).

Each setting runs twice, alternating, in one process, so that both see the same host phases.

Usage (GPU machine, repository root): OUT=dir python benchmarks/eager_graph_range_probe.py [--prefill]
Writes OUT/eager_graph_range_probe.json (or eager_graph_prefill_probe.json).
"""

from __future__ import annotations

import json
import os
import sys

import twell.eager_graphs as EG
from twell.bench.runtime import batch_grid

OUT = os.environ.get("OUT", ".")
PREFILL = "--prefill" in sys.argv
Ms, ks = ((4096, 6144), (8, 29)) if PREFILL else ((128, 256, 512), (29, 280))
settings = (False, True) if PREFILL else (64, 512)
runs = []
for rnd in range(2):
    for setting in settings:
        if PREFILL:
            EG.PREFILL_BAND = setting
        else:
            EG.MAX_M = setting
        recs = batch_grid(Ms=Ms, ks=ks, dists=("even",),
                          log=lambda s, v=setting: print(f"{'PREFILL_BAND' if PREFILL else 'MAX_M'} {v}: {s}", flush=True))
        runs.append({"round": rnd, "setting": setting, "records": recs})
name = "eager_graph_prefill_probe.json" if PREFILL else "eager_graph_range_probe.json"
with open(os.path.join(OUT, name), "w") as fh:
    json.dump(runs, fh, indent=1)
print(f"\nM    k   eager speedup by {'PREFILL_BAND' if PREFILL else 'MAX_M'} (two rounds; * = replayed)")
for M in Ms:
    for k in ks:
        cells = []
        for run in runs:
            r = next(r for r in run["records"] if r["M"] == M and r["k"] == k)
            cells.append(f"{run['setting']}:{r['speedup']:.3f}{'*' if r['eager_graph'] else ''} ({r['path']})")
        print(M, k, " ".join(cells))
