"""The inference module with and without hot units (``twell.inference.dispatch.HOT_UNITS``), as the
inference grid times it (``run_grid``, module only: dense and twell in alternation, three rounds,
medians), on the cases the hot block is for (skewed units) and those it must leave alone.

    python benchmarks/hot_units_ab.py OUTDIR

Writes OUTDIR/hot_units_ab_<gpu>.json; prints one line per record and flag.
"""

from __future__ import annotations

import json
import os
import sys

from twell.inference import dispatch
from twell.bench.cli import _gpu_tag
from twell.bench.inference import machine_info, run_grid

OUT = sys.argv[1]
no_kernels = lambda M, f, k: False  # noqa: E731  (the module only)
CASES = [([131072, 65536], [29, 56], ["skewed"]), ([16384], [29], ["skewed"]), ([131072, 65536], [29], ["even", "heavy"])]
records = []
for Ms, ks, dists in CASES:
    for flag in (False, True):
        dispatch.HOT_UNITS = flag
        for r in run_grid([(2048, 5632)], Ms, ks, dists, kernel_k_limit=no_kernels, rep=60, log=lambda s: None):
            r["hot_flag"] = flag
            records.append(r)
            print(f"[hot {flag}] M {r['M']} k {r['k']} {r['distribution']}: dense {r['dense_ms']:.3f} twell {r['twell_ms']:.3f} ms "
                  f"({r['speedup']:.3f}x, {r['twell_path']}, hot {r['hot_units']}) rel_err {r['rel_err']:.1e} "
                  f"row {r['max_row_err']:.1e} / dense {r['dense_max_row_err']:.1e}", flush=True)
        with open(os.path.join(OUT, f"hot_units_ab_{_gpu_tag()}.json"), "w") as fh:
            json.dump(dict(machine=machine_info(), records=records), fh, indent=1)
