"""Issue 8/9: the module's dense branch against the three-nn.Linear MLP at 64 to 4096 tokens, in
CUDA graphs (L2 flushed), H200, bf16, d 2048, f 5632: relu(g) * u as the Triton pass
(twell.kernels.elementwise.relu_mul_) or as two in-place PyTorch ops, beside PyTorch's
relu(g) * u.

    OUT=dir python benchmarks/dense_elementwise_probe.py   # writes OUT/dense_elementwise.json
"""

import json
import os

import torch
import torch.nn.functional as F

from twell.bench.timing import graph_ms
from twell.kernels.elementwise import relu_mul_

D, FF = 2048, 5632
torch.manual_seed(0)
wg, wu = (torch.randn(FF, D, device="cuda", dtype=torch.bfloat16) / 45 for _ in range(2))
wd = torch.randn(D, FF, device="cuda", dtype=torch.bfloat16) / 75
view = wd.t().contiguous().t()
out = []
for M in (64, 128, 256, 512, 1024, 4096):
    x = torch.randn(M, D, device="cuda", dtype=torch.bfloat16)
    variants = {
        "torch_mlp": lambda: F.linear(F.relu(F.linear(x, wg)) * F.linear(x, wu), wd),
        "triton_pass": lambda: F.linear(relu_mul_(F.linear(x, wu), F.linear(x, wg)), view),
        "inplace_ops": lambda: F.linear(F.linear(x, wu).mul_(F.linear(x, wg).relu_()), view),
    }
    rec = {"M": M}
    for rnd in range(2):
        for name, fn in variants.items():
            rec[f"{name}_{rnd}"] = 1e3 * graph_ms(fn)
    out.append(rec)
    print(" ".join(f"{k} {v:.1f}" if isinstance(v, float) else f"{k} {v}" for k, v in rec.items()), flush=True)
with open(os.path.join(os.environ.get("OUT", "/tmp"), "dense_elementwise.json"), "w") as fh:
    json.dump(out, fh, indent=1)
