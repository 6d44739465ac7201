"""Issue 9, next step: one list of fires (shipped) against one list per token
(`SplitConfig(per_token=True)`: a token's fires added up in registers per program, heavy
tokens' overflow done by the gate on tensor cores). The decode grid's records (the module in
CUDA graphs, as `twell bench decode` times them) at 4 to 64 tokens, forced onto the split kernels
(`decode_graph_us`), for even, skewed and heavy batches, both layouts alternating, twice.

    OUT=dir python benchmarks/decode_split_layouts.py   # writes OUT/split_layouts.json
"""

import json
import os

from twell import dispatch
from twell.bench.runtime import decode_grid
from twell.kernels import decode_split

# every batch here on the split kernels, heavy ones too (the rule would send those elsewhere)
dispatch.SPLIT_MAX_FIRES = dispatch.SPLIT_MAX_ROW_FIRES = 10**9
base = decode_split.SPLIT_CONFIG
out = {}
for name, per_token in [("one_list", False), ("per_token", True), ("one_list_b", False), ("per_token_b", True)]:
    decode_split.SPLIT_CONFIG = base._replace(per_token=per_token)
    recs = decode_grid(Ms=(4, 16, 32, 64), ks=(8, 29, 56), dists=("even", "skewed", "heavy"), log=lambda s: None)
    out[name] = recs
    print(f"{name:12s}", " ".join(f"M{r['M']}k{r['k']}{r['distribution'][0]} {r['decode_graph_us']:.1f}" for r in recs), flush=True)
decode_split.SPLIT_CONFIG = base
with open(os.path.join(os.environ.get("OUT", "/tmp"), "split_layouts.json"), "w") as fh:
    json.dump(out, fh, indent=1)
