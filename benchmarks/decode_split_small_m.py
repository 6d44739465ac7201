"""Issue 9: from how many tokens do the split decode kernels beat the fused ones? The decode
grid's records (the module in CUDA graphs, as `twell bench decode` times it) at 1 to 8 tokens,
with the split kernels taking every size (SPLIT_MIN_M = 1) and with them off, alternating, twice.

    OUT=dir python benchmarks/decode_split_small_m.py   # writes OUT/split_small_m.json
"""

import json
import os

from twell import dispatch
from twell.bench.runtime import decode_grid

out = {}
for name, on in [("split", True), ("fused", False), ("split_b", True), ("fused_b", False)]:
    dispatch.DECODE_SPLIT, dispatch.SPLIT_MIN_M = on, 1
    recs = decode_grid(Ms=(1, 2, 3, 4, 6, 8), dists=("even",), log=lambda s: None)
    out[name] = recs
    print(f"{name:8s}", " ".join(f"M{r['M']}k{r['k']} {r['decode_graph_us']:.1f}" for r in recs), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "split_small_m.json"), "w") as fh:
    json.dump(out, fh, indent=1)
