"""The inference module (`SparseGatedMLP`, eval, track_stats off) against dense PyTorch at a few
sizes, as the inference grid times it (`twell.bench.inference.run_grid`, module only: dense and
twell in alternation, three rounds, medians), for an A/B of two trees: run it with each tree's
``src`` first on PYTHONPATH and compare the ratios. Take the old tree from an explicit commit
(``git archive <hash> src``): on the device machine ``HEAD`` is not this checkout's (in the
twenty-seventh session it stayed at the session's first commit; NOTES_inference).

    python benchmarks/infer_module_ab.py OUTDIR LABEL

Writes OUTDIR/infer_module_ab_LABEL.json; prints one line per record.
"""

from __future__ import annotations

import json
import os
import sys

from twell.bench.inference import machine_info, run_grid

OUT, LABEL = sys.argv[1], sys.argv[2]
no_kernels = lambda M, f, k: False  # noqa: E731  (the module only, not the forced ops' stages)
records = run_grid([(2048, 5632)], [4096, 16384, 131072], [8, 29, 56], ["even"], kernel_k_limit=no_kernels, rep=60, log=lambda s: None)
records += run_grid([(2048, 5632)], [131072], [29], ["skewed", "heavy"], kernel_k_limit=no_kernels, rep=60, log=lambda s: None)
with open(os.path.join(OUT, f"infer_module_ab_{LABEL}.json"), "w") as fh:
    json.dump(dict(machine=machine_info(), label=LABEL, records=records), fh, indent=1)
for r in records:
    print(f"[{LABEL}] M {r['M']} k {r['k']} {r['distribution']}: dense {r['dense_ms']:.3f} twell {r['twell_ms']:.3f} ms "
          f"({r['dense_ms'] / r['twell_ms']:.3f}x, {r.get('twell_path')}) rel_err {r.get('rel_err', float('nan')):.1e}", flush=True)
