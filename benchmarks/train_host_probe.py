"""Host side of one sparse training call, and the dense rows' forward pass by block shape
(seventh session of 2026-12-01).

1. ``sparse_gated_ffn`` forward + backward at M 16384, k 8 and 29 even: the profiler's CPU
   operators by self CPU time (which launches and PyTorch calls the host spends its time on while
   the GPU, drained by the forward's host synchronisation, waits).
2. ``twell.kernels.dense_rows`` forward pass (a, u -> h, |h| per row, counts per unit and per
   row) at M 16384 and 65536, f 5632, bf16, over block shapes, with and without the per-unit
   atomics, against PyTorch's relu and product.

    python benchmarks/train_host_probe.py [OUTDIR]
"""

from __future__ import annotations

import json
import os
import sys

import torch
import triton

from twell.bench.inference import bench_ms, machine_info
from twell.kernels import dense_rows as DR
from train_paths_probe import inputs
from twell.bench.training import _sparse_fn
from twell.train_ops import choose_width

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")


def host_table(M, k):
    from torch.profiler import ProfilerActivity, profile

    x, wg, wu, wd, dy = inputs(M, k)
    with torch.no_grad():
        counts = (torch.mm(x, wg.t()) > 0).sum(1)
    fn = _sparse_fn(x, wg, wu, wd, dy, choose_width(float(counts.float().mean()), int(counts.max()), wg.shape[0]))
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    table = prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=45)
    import time

    t = []
    for _ in range(20):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        t.append((time.perf_counter() - t0) * 1e3)
    return table, sorted(t)[len(t) // 2]


def forward_sweep(M, f=5632):
    g = torch.Generator(device="cuda").manual_seed(0)
    a = (torch.randn(M, f, device="cuda", generator=g) - 2.5).to(torch.bfloat16)
    u = torch.randn(M, f, device="cuda", generator=g).to(torch.bfloat16)
    h = torch.empty_like(a)
    l1 = torch.empty(M, device="cuda")
    rc = torch.empty(M, dtype=torch.int32, device="cuda")
    cnt = torch.zeros(f, dtype=torch.int32, device="cuda")
    res = {"torch_relu_mul": bench_ms(lambda: torch.relu(a) * u, rep=30),
           "shipped": bench_ms(lambda: DR.dense_rows_forward(a, u), rep=30)}
    for bm, bf in ((16, 256), (32, 128), (64, 64), (8, 512), (32, 256), (64, 128), (128, 64)):
        for nw in (4, 8):
            key = f"{bm}x{bf}x{nw}"
            try:
                res[key] = bench_ms(lambda: DR._forward_kernel[(triton.cdiv(M, bm),)](a, u, h, l1, cnt, rc, M, f, GATED=True,
                                                                                       BM=bm, BF=bf, num_warps=nw), rep=30)
            except Exception as e:  # noqa: BLE001 (a shape the compiler refuses: recorded)
                res[key] = f"failed: {type(e).__name__}"
    return res


def main() -> None:
    out = dict(machine_info())
    for M, k in ((16384, 8), (16384, 29)):
        table, wall = host_table(M, k)
        out[f"host_M{M}_k{k}"] = table
        out[f"wall_ms_M{M}_k{k}"] = wall
        print(f"== sparse op M {M} k {k}: wall {wall:.3f} ms per call (synchronised)\n{table}", flush=True)
    for M in (16384, 65536):
        r = forward_sweep(M)
        out[f"forward_sweep_M{M}"] = r
        print(f"dense rows forward M {M}: " + ", ".join(f"{n} {v if isinstance(v, str) else round(v, 3)}" for n, v in r.items()), flush=True)
    with open(os.path.join(OUT, "train_host_probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
