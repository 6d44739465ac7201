"""Where the time of a training call goes on its two module paths (seventh session of 2026-12-01):

1. The dense path: :func:`twell.train_ops.dense_gated_ffn` against the plain PyTorch MLP, the
   whole forward + backward and each stage (the nine cuBLAS products, twell's two fused
   element-wise passes against PyTorch's relu, product and their gradients).
2. The module against the op it calls: ``SparseGatedMLP`` (train_kernels auto, statistics on)
   and ``sparse_gated_ffn`` forced, timed call by call in turn, and one call of each under the
   profiler: the sum of kernel times, the span from the first kernel to the last, and the GPU's
   idle gaps (the sparse op synchronises with the host once in its forward, so host time after
   that point can leave the GPU waiting).

    python benchmarks/train_paths_probe.py [OUTDIR] [--module-only]

Writes OUTDIR/train_paths_probe.json; prints tables.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from twell.bench.inference import bench_ms
from twell.bench.synthetic import make_ffn
from twell.bench.timing import interleaved_ms
from twell.bench.training import LAM, _dense_fn, _module_fn, _sparse_fn
from twell.kernels.dense_rows import dense_rows_backward, dense_rows_forward
from twell.train_ops import choose_width, dense_gated_ffn

OUT = next((a for a in sys.argv[1:] if not a.startswith("--")), os.environ.get("OUT", "/tmp"))
F = torch.nn.functional


def inputs(M, k, dist="even", d=2048, f=5632):
    ffn = make_ffn(M, d, f, k, dist, torch.bfloat16, "cuda", seed=k)
    x = ffn.x.requires_grad_(True)
    wg, wu, wd = (w.requires_grad_(True) for w in (ffn.w_gate, ffn.w_up, ffn.w_down))
    dy = torch.randn(M, d, device="cuda", dtype=torch.bfloat16) / math.sqrt(d)
    return x, wg, wu, wd, dy


def dense_stages(M, k):
    x, wg, wu, wd, dy = inputs(M, k)
    lam = torch.full((), LAM, device="cuda")

    def dense_path():
        out = dense_gated_ffn(x, wg, wu, wd)
        return torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam))

    plain = _dense_fn(x, wg, wu, wd, dy)
    rec = dict(M=M, k=k)
    calls = max(10, min(60, int(1500 / (M / 16384 * 5))))
    rec["plain_ms"], rec["dense_path_ms"] = interleaved_ms([plain, dense_path], calls=calls, warmup=3)
    with torch.no_grad():
        a, u = torch.mm(x, wg.t()), torch.mm(x, wu.t())
        h, _, _, _ = dense_rows_forward(a, u)
        dz = torch.mm(dy, wd)
        g = torch.relu(a)
        c = torch.zeros(1, device="cuda")
        st = {
            "mm_gate": lambda: torch.mm(x, wg.t()),
            "mm_down_fwd": lambda: torch.mm(h, wd.t()),
            "mm_dz": lambda: torch.mm(dy, wd),
            "mm_dx_pair_addmm": lambda: torch.addmm(torch.mm(dz, wg), dz, wu),
            "mm_dx_pair_add": lambda: torch.mm(dz, wg).add_(torch.mm(dz, wu)),
            "mm_dw_up": lambda: torch.mm(dz.t(), x),
            "mm_dw_down_df": lambda: torch.mm(dy.t(), h),
            "mm_dw_down_fd": lambda: torch.mm(h.t(), dy),
            "fused_forward_pass": lambda: dense_rows_forward(a, u),
            "fused_backward_pass": lambda: dense_rows_backward(dz.clone(), a, u, c),
            "clone_dz": lambda: dz.clone(),
            "torch_forward_relu_mul": lambda: torch.relu(a) * u,
            "torch_backward_elementwise": lambda: (torch.ops.aten.threshold_backward(dz * u, g, 0), dz * g),
            "torch_l1_and_counts": lambda: (h.abs().sum(1, dtype=torch.float32), (a > 0).sum(0), (a > 0).sum(1)),
        }
        rec["stages_ms"] = {n: bench_ms(fn, rep=30) for n, fn in st.items()}
    del x, wg, wu, wd, dy, a, u, h, dz, g
    torch.cuda.empty_cache()
    return rec


def gaps(fn):
    """One profiled call: (sum of kernel times, span first kernel start to last end, idle gaps
    over 20 us summed, number of such gaps), microseconds."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    ev = sorted((e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA and e.time_range.elapsed_us() >= 0),
                key=lambda e: e.time_range.start)
    if not ev:
        return dict(kernel_us=0.0, span_us=0.0, idle_us=0.0, idle_gaps=0)
    busy = sum(e.time_range.elapsed_us() for e in ev)
    idle, n, end = 0.0, 0, ev[0].time_range.end
    for e in ev[1:]:
        gap = e.time_range.start - end
        if gap > 20:
            idle += gap
            n += 1
        end = max(end, e.time_range.end)
    return dict(kernel_us=busy, span_us=end - ev[0].time_range.start, idle_us=idle, idle_gaps=n, kernels=len(ev))


def module_overhead(M, k, dist):
    x, wg, wu, wd, dy = inputs(M, k, dist)
    with torch.no_grad():
        counts = (torch.mm(x, wg.t()) > 0).sum(1)
    width = choose_width(float(counts.float().mean()), int(counts.max()), wg.shape[0])
    sparse = _sparse_fn(x, wg, wu, wd, dy, width)
    module, m = _module_fn(x, wg, wu, wd, dy)
    calls = 60 if M <= 16384 else 25
    rec = dict(M=M, k=k, distribution=dist, width=width, module_width=m._twell_train.width, module_path=m.last_train_path)
    rec["dense_ms"], rec["sparse_ms"], rec["module_ms"] = interleaved_ms([_dense_fn(x, wg, wu, wd, dy), sparse, module],
                                                                          calls=calls, warmup=3)
    rec["sparse_profile"] = gaps(sparse)
    rec["module_profile"] = gaps(module)
    del x, wg, wu, wd, dy, sparse, module, m
    torch.cuda.empty_cache()
    return rec


def main() -> None:
    res = {"dense": [], "module": []}
    for M, k in (() if "--module-only" in sys.argv else ((16384, 8), (65536, 8), (65536, 5632))):
        r = dense_stages(M, k)
        res["dense"].append(r)
        print(f"dense path M {M} k {k}: plain {r['plain_ms']:.3f} ms, twell dense path {r['dense_path_ms']:.3f} ms; stages "
              + ", ".join(f"{n} {v:.3f}" for n, v in r["stages_ms"].items()), flush=True)
    for M, k, dist in ((16384, 8, "even"), (16384, 29, "even"), (16384, 16, "heavy"), (65536, 29, "even")):
        r = module_overhead(M, k, dist)
        res["module"].append(r)
        sp, mp = r["sparse_profile"], r["module_profile"]
        print(f"module M {M} k {k} {dist} (W {r['width']} / module {r['module_width']}, {r['module_path']}): dense "
              f"{r['dense_ms']:.3f}, op {r['sparse_ms']:.3f}, module {r['module_ms']:.3f} ms | profile op: kernels "
              f"{sp['kernel_us']:.0f} us of span {sp['span_us']:.0f}, idle {sp['idle_us']:.0f} in {sp['idle_gaps']} gaps "
              f"({sp['kernels']} kernels); module: {mp['kernel_us']:.0f} of {mp['span_us']:.0f}, idle {mp['idle_us']:.0f} "
              f"in {mp['idle_gaps']} ({mp['kernels']} kernels)", flush=True)
    from twell.bench.inference import machine_info

    res.update(machine_info())
    with open(os.path.join(OUT, "train_paths_probe.json"), "w") as fh:
        json.dump(res, fh, indent=1)


if __name__ == "__main__":
    main()
