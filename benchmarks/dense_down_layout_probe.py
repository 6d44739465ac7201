"""Issue 8/9: does the eval-mode layout of w_down (stored as [f, d] rows for the kernels, so the
module's dense path multiplies by a transposed view) cost the dense path's down product time
against nn.Linear's [d, f] weight? The down product alone and the module's whole dense branch,
both in CUDA graphs (L2 flushed), H200, bf16, d 2048, f 5632.

    OUT=dir python benchmarks/dense_down_layout_probe.py   # writes OUT/dense_down_layout.json
"""

import json
import os

import torch
import torch.nn.functional as F

from twell.bench.timing import graph_ms

D, FF = 2048, 5632
torch.manual_seed(0)
wd = torch.randn(D, FF, device="cuda", dtype=torch.bfloat16) / 75
wdt = wd.t().contiguous()  # [f, d]: the kernels' layout
view = wdt.t()  # [d, f] view of it: what the module's dense path passes to F.linear
out = []
for M in (16, 64, 256, 1024, 4096):
    h = torch.randn(M, FF, device="cuda", dtype=torch.bfloat16)
    rec = {"M": M}
    for name, fn in (("linear_contiguous", lambda: F.linear(h, wd)), ("linear_view", lambda: F.linear(h, view)),
                     ("mm_rows", lambda: torch.mm(h, wdt)), ("linear_contiguous_b", lambda: F.linear(h, wd)),
                     ("linear_view_b", lambda: F.linear(h, view))):
        rec[name] = 1e3 * graph_ms(fn)
    out.append(rec)
    print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "dense_down_layout.json"), "w") as fh:
    json.dump(out, fh, indent=1)
