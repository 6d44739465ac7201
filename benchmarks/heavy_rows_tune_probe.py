"""Tile shapes of the heavy rows' forward (``twell.kernels.heavy_rows``, ``twell.train_ops.HEAVY_CONFIG``)
against what it replaced (cuBLAS on the gathered rows, the fused element-wise pass, the scatter;
it needed the count on the host): bf16, d 2048, f 5632, M 16384, n heavy rows listed, each
about half its units active.

    python benchmarks/heavy_rows_tune_probe.py [OUTDIR]

Writes OUTDIR/heavy_rows_tune_probe.json; prints a table (ms, medians of do_bench).
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from twell.bench.inference import bench_ms, machine_info
from twell.kernels.dense_rows import dense_rows_forward
from twell.kernels.heavy_rows import heavy_rows_forward

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
CONFIGS = [  # block_m, block_n, block_k, num_warps, num_stages
    (64, 128, 64, 4, 3), (128, 128, 64, 8, 3), (64, 64, 64, 4, 4), (128, 64, 64, 4, 3),
    (64, 128, 32, 4, 4), (128, 128, 32, 8, 4), (64, 256, 64, 8, 3), (32, 128, 64, 4, 3), (128, 256, 64, 8, 3),
]


def main() -> None:
    M, d, f = 16384, 2048, 5632
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, d, generator=g, device="cuda").bfloat16()
    wg = (torch.randn(f, d, generator=g, device="cuda") / math.sqrt(d)).bfloat16()
    wu = (torch.randn(f, d, generator=g, device="cuda") / math.sqrt(d)).bfloat16()
    wd = (torch.randn(d, f, generator=g, device="cuda") / math.sqrt(f)).bfloat16()
    a0 = torch.mm(x, wg.t())
    y = torch.zeros(M, d, device="cuda", dtype=torch.bfloat16)
    res = {"records": [], **machine_info()}
    for n in (164, 1638, 8192):
        rows = torch.randperm(M, generator=g, device="cuda")
        n_t = torch.tensor([n], device="cuda")
        a = a0.clone()

        def cublas(r=rows[:n]):
            x_r = x[r]
            h, _, _, _ = dense_rows_forward(a0[r], torch.mm(x_r, wu.t()))
            y[r] = torch.mm(h, wd.t())

        rec = dict(n=n, cublas_gathered_ms=bench_ms(cublas, rep=50), configs={})
        for bm, bn, bk, w, s in CONFIGS:
            cfg = dict(block_m=bm, block_n=bn, block_k=bk, num_warps=w, num_stages=s)
            try:
                ms = bench_ms(lambda: heavy_rows_forward(x, a, rows, n_t, y, wd, wu, **cfg), rep=50)
            except Exception as e:  # a shape that does not fit the shared memory
                ms = None
                print(f"n {n} {cfg}: {type(e).__name__}: {str(e)[:120]}", flush=True)
            rec["configs"][f"{bm}x{bn}x{bk}w{w}s{s}"] = ms
        res["records"].append(rec)
        best = min((v, k) for k, v in rec["configs"].items() if v is not None)
        flops = 2 * 2 * n * d * f
        print(f"n {n:5d}: cuBLAS gathered {rec['cublas_gathered_ms']:.3f} ms; heavy_rows "
              + ", ".join(f"{k} {v:.3f}" for k, v in rec["configs"].items() if v is not None)
              + f" | best {best[1]} {best[0]:.3f} ms ({flops / best[0] / 1e9:.0f} TFLOP/s)", flush=True)
    with open(os.path.join(OUT, "heavy_rows_tune_probe.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
