"""Where one training call's GPU time goes on skewed units against even ones (the module with
default settings, forward + backward, bf16, M 16384, d 2048, f 5632): the grid of the fifty-fifth
session read k 8 3.15x even against 2.25x skewed, k 29 1.81x against 1.45x, though skewed units
gather from fewer distinct weight rows.

    python benchmarks/train_skewed_profile.py [OUTDIR]

Prints per case the kernels' GPU time per call and the kernels that take longest; writes
OUTDIR/train_skewed_profile.json.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
from torch.profiler import ProfilerActivity, profile

from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.training import _module_fn

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
CASES = [(16384, 29, "even"), (16384, 29, "skewed"), (16384, 8, "even"), (16384, 8, "skewed")]


def profile_case(M: int, k: float, dist: str, calls: int = 10) -> dict:
    s = make_ffn(M, 2048, 5632, k, dist, device="cuda")
    x, wg, wu, wd = (t.detach().requires_grad_(True) for t in (s.x, s.w_gate, s.w_up, s.w_down))
    dy = torch.randn_like(x) / math.sqrt(2048)
    run, m = _module_fn(x, wg, wu, wd, dy)
    for _ in range(3):
        run()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            run()
        torch.cuda.synchronize()
    kernels = {}
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t > 0 and e.count >= calls:
            kernels[e.key] = dict(us_per_call=t / calls, count_per_call=e.count / calls)
    total = sum(v["us_per_call"] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1]["us_per_call"])[:14]
    print(f"M {M} k {k} {dist}: path {m.last_train_path}, kernels {total / 1000:.3f} ms per call", flush=True)
    for name, v in top:
        print(f"   {v['us_per_call']:8.1f} us  x{v['count_per_call']:.0f}  {name[:110]}", flush=True)
    return dict(M=M, k=k, dist=dist, path=m.last_train_path, kernels_ms=total / 1000, kernels=kernels)


def main() -> None:
    recs = [profile_case(*c) for c in CASES]
    with open(os.path.join(OUT, "train_skewed_profile.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), records=recs), fh, indent=1)


if __name__ == "__main__":
    main()
