"""Device check (twenty-fifth session): the heavy-rows training case of train_op_ab.py (M 16384,
k 29, "heavy") repeated, with the ELL pack timed alone on the same pre-activation, for one tree
(run once per tree with its ``src`` first on PYTHONPATH).

    python benchmarks/train_heavy_ab.py LABEL
"""

from __future__ import annotations

import sys

import torch

from train_auto_rule_probe import case, synthetic  # (benchmarks/ is on the path)
from twell.bench.inference import bench_ms
from twell.kernels.train_ffn import pack_rows
from twell.train_ops import PACK_CONFIG

LABEL = sys.argv[1] if len(sys.argv) > 1 else "run"
for dist in ("heavy", "even"):
    t = synthetic(16384, 29, dist)
    with torch.no_grad():
        a = torch.mm(t[0], t[1].t())
    print(f"[{LABEL}] {dist} pack_rows W64 {PACK_CONFIG}: {bench_ms(lambda: pack_rows(a, 64, **PACK_CONFIG)):.4f} ms", flush=True)
    for rep in range(2):
        r = case(f"{dist} k29 rep{rep}", 16384, t, calls=30)
        print(f"[{LABEL}] {dist} rep {rep}: module {r['module_ms']:.3f} ms ({r['dense_ms_module'] / r['module_ms']:.2f}x), "
              f"W64 {r['sparse'][0]['ms']:.3f} ms ({r['sparse'][0]['speedup']:.2f}x)", flush=True)
    del t, a
    torch.cuda.empty_cache()
