"""Issue 9: one unit or two per program for the CUDA-core decode kernel at 2 to 5 tokens? The
decode grid's records at M = 2 and 4 (the module in CUDA graphs, as `twell bench decode` times
it), with each shape in turn, twice (alternating), on the GPU.

    OUT=dir python benchmarks/decode_gemv_small_m_check.py   # writes OUT/m4_gemv_bu.json
"""

import json
import os

import twell.kernels.decode_fused as F
from twell.bench.runtime import decode_grid

out = {}
for name, cfg in [("bu2", F.GemvConfig(2, 2048, 2, 1)), ("bu1", F.GemvConfig(1, 2048, 2, 1)),
                  ("bu2b", F.GemvConfig(2, 2048, 2, 1)), ("bu1b", F.GemvConfig(1, 2048, 2, 1))]:
    F.GEMV_CONFIGS = {1: F.GemvConfig(1, 2048, 2, 1), 5: cfg}
    recs = decode_grid(Ms=(2, 4), log=lambda s: None)
    out[name] = recs
    print(name, " ".join(f"M{r['M']}k{r['k']}{r['distribution'][0]} {r['twell_graph_us']:.1f}/{r['dense_graph_us']:.1f}"
                         for r in recs), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "m4_gemv_bu.json"), "w") as fh:
    json.dump(out, fh, indent=1)
