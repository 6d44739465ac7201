"""One layer's training call (forward + backward, bf16, d 2048, f 5632) at a few sizes and
patterns, each variant timed in turn with dense PyTorch: the module with default settings, the
sparse op forced at the width "auto" gives, twell's dense op
(:func:`train_auto_rule_probe.case`). For A/B runs of two trees: run it once with each tree's
``src`` first on PYTHONPATH and compare the ratios.

    python benchmarks/train_op_ab.py [OUTDIR] [LABEL]

Writes OUTDIR/train_op_ab_LABEL.json; prints one line per case.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from train_auto_rule_probe import case, synthetic  # (benchmarks/ is on the path)
from twell.bench.inference import machine_info

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
OUT = ARGS[0] if ARGS else os.environ.get("OUT", "/tmp")
LABEL = ARGS[1] if len(ARGS) > 1 else "run"
CASES = [("even", 29, 4096), ("even", 29, 8192), ("even", 8, 16384), ("even", 29, 16384), ("skewed", 29, 16384),
         ("heavy", 29, 16384), ("even", 29, 65536)]


def main() -> None:
    import twell

    records = []
    for dist, k, M in CASES:
        records.append(case(f"{dist} k{k}", M, synthetic(M, k, dist), calls=30))
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, f"train_op_ab_{LABEL}.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), label=LABEL, twell=os.path.dirname(twell.__file__), records=records), fh, indent=1)


if __name__ == "__main__":
    main()
