"""Device experiment: which eager calls should replay twell's own CUDA graphs, and what the
output's copy costs there?

- Default: up to how many tokens (``twell.eager_graphs.MAX_M``). ``twell bench batch``'s records
  at 128 to 1024 tokens with MAX_M 64 (those sizes run eagerly) and 1024 (replayed), the latter
  with the output copied out of the graph (``HAND_OUT`` False) or handed out.
- ``--small``: 1, 16 and 64 tokens (always replayed), the output copied or handed out.
- ``--prefill``: the prefill band (``twell.eager_graphs.PREFILL_BAND``). Records at 4096 and 6144
  tokens with the band off (eager dense) and on (a replayed graph of the prefill kernels), the
  output copied or handed out.

Each setting runs twice, alternating, in one process, so that both see the same host phases.

Usage (GPU machine, repository root): OUT=dir python benchmarks/eager_graph_range_probe.py [--small | --prefill]
Writes OUT/eager_graph_{range,small,prefill}_probe.json.
"""

from __future__ import annotations

import json
import os
import sys

import twell.eager_graphs as EG
from twell.bench.runtime import batch_grid

OUT = os.environ.get("OUT", ".")
MODE = "prefill" if "--prefill" in sys.argv else "small" if "--small" in sys.argv else "range"
# name: eager_graphs settings
if MODE == "prefill":
    Ms, ks = (4096, 6144), (8, 29)
    settings = {"band off": dict(PREFILL_BAND=False), "band, copy": dict(PREFILL_BAND=True, HAND_OUT=False),
                "band, hand out": dict(PREFILL_BAND=True, HAND_OUT=True)}
elif MODE == "small":
    Ms, ks = (1, 16, 64), (29,)
    settings = {"copy": dict(HAND_OUT=False), "hand out": dict(HAND_OUT=True)}
else:
    Ms, ks = (128, 256, 512, 1024), (29, 280)
    settings = {"MAX_M 64": dict(MAX_M=64), "1024, copy": dict(MAX_M=1024, HAND_OUT=False),
                "1024, hand out": dict(MAX_M=1024, HAND_OUT=True)}
runs = []
for rnd in range(2):
    for name, values in settings.items():
        for key, value in values.items():
            setattr(EG, key, value)
        recs = batch_grid(Ms=Ms, ks=ks, dists=("even",), log=lambda s, n=name: print(f"{n}: {s}", flush=True))
        runs.append({"round": rnd, "setting": name, "values": values, "records": recs})
with open(os.path.join(OUT, f"eager_graph_{MODE}_probe.json"), "w") as fh:
    json.dump(runs, fh, indent=1)
print("\nM    k   eager speedup / graph speedup / twell peak MiB by setting (two rounds; * = replayed)")
for M in Ms:
    for k in ks:
        cells = []
        for run in runs:
            r = next(r for r in run["records"] if r["M"] == M and r["k"] == k)
            cells.append(f"{run['setting']}: {r['speedup']:.3f}{'*' if r['eager_graph'] else ''} / "
                         f"{r['graph_speedup']:.3f} / {r['peak_bytes'] / 2**20:.0f}")
        print(M, k, " | ".join(cells))
