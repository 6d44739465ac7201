"""Device experiment: the sparse training op with ``w_down`` held in the kernels' layout (the
transpose of a contiguous ``[f, d]`` matrix, as eval mode keeps it) against the ``nn.Linear``
layout, where each forward and each backward copies ``w_down^T`` (0.08 ms at d 2048, f 5632) and
the weight gradient (laid out ``[f, d]``) is copied into the parameter's layout.

Usage (GPU machine, repository root): OUT=dir [PROFILE_K=8,29] python benchmarks/train_layout_probe.py
(PROFILE_K: also a torch.profiler table of both layouts for those k; PROFILE_CPU=1: with the host's
side, sorted by self CPU time: the k 8 loss of the kernel layout is outside the GPU kernels)
bf16, d 2048, f 5632, even units (and one case with heavy rows); forward + backward with ``.backward()`` into ``.grad`` (as a
training step accumulates), grads reset to None each call; dense = the three-Linear MLP, same
weights; call by call in turn, L2 flushed, medians. Writes OUT/train_layout_probe.json.
"""

from __future__ import annotations

import json
import math
import os

import torch

from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.timing import interleaved_ms
from twell.train_ops import choose_width, sparse_gated_ffn

OUT = os.environ.get("OUT", ".")
os.makedirs(OUT, exist_ok=True)
SMOKE = os.environ.get("TWELL_SMOKE") == "1"
d, f = (64, 300) if SMOKE else (2048, 5632)
DEV, DT = ("cpu", torch.float32) if SMOKE else ("cuda", torch.bfloat16)
# (M, k, distribution); "heavy": a tenth of the rows past the ELL width (the dense backup's path)
CASES = [(96, 20, "heavy")] if SMOKE else [(16384, 8, "even"), (16384, 29, "even"), (65536, 29, "even"), (16384, 29, "heavy")]
LAM = 2e-5
info = machine_info()


def _drained(fn):
    """``fn`` after a synchronisation: nothing of the previous call is still queued when it starts."""
    def run():
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        fn()
    return run


records = []
F = torch.nn.functional

for M, k, dist in CASES:
    s = make_ffn(M, d, f, k, dist, DT, DEV, seed=k)
    x = s.x.requires_grad_(True)
    wg, wu = (w.requires_grad_(True) for w in (s.w_gate, s.w_up))
    wd = s.w_down.clone().requires_grad_(True)
    # the same values as the transpose of a contiguous [f, d] matrix: a leaf with strides (1, d)
    wd_k = torch.empty_strided((d, f), (1, d), dtype=DT, device=DEV).copy_(s.w_down).requires_grad_(True)
    dy = torch.randn(M, d, dtype=DT, device=DEV) / math.sqrt(d)
    with torch.no_grad():
        counts = (x @ wg.t() > 0).sum(1)
    width = choose_width(float(counts.float().mean()), int(counts.max()), f)
    lam = torch.full((), LAM, device=DEV)
    params = (x, wg, wu, wd, wd_k)

    def reset():
        for p in params:
            p.grad = None

    def dense():
        reset()
        F.linear(torch.relu(F.linear(x, wg)) * F.linear(x, wu), wd).backward(dy)

    def sparse(w):
        def run():
            reset()
            out = sparse_gated_ffn(x, wg, wu, w, width)
            torch.autograd.backward((out.y, out.l1), (dy, lam))
        return run

    sparse(wd)()
    g_lin = wd.grad.clone()
    sparse(wd_k)()
    g_k = wd_k.grad.clone()
    same = bool(torch.equal(g_lin, g_k))
    layout_kept = wd_k.grad.stride() == wd_k.stride()
    calls, warm = (3, 1) if SMOKE else (40, 3)
    t = interleaved_ms([dense, sparse(wd), sparse(wd_k)], calls=calls, warmup=warm)
    # The same three in the other order, and with the GPU drained before each call: is the
    # kernel layout's loss at k 8 its own, or the order's (a call's host waits mid-call for its
    # counts, so what the previous call left queued shapes its timed window)?
    t_rev = interleaved_ms([dense, sparse(wd_k), sparse(wd)], calls=calls, warmup=warm)
    t_sync = interleaved_ms([_drained(fn) for fn in (dense, sparse(wd), sparse(wd_k))], calls=calls, warmup=warm)
    rec = dict(M=M, k=k, distribution=dist, width=width, heavy_rows=int((counts > width).sum()), dense_ms=t[0], linear_layout_ms=t[1], kernel_layout_ms=t[2],
               speedup_linear=t[0] / t[1], speedup_kernel=t[0] / t[2],
               reversed_order=dict(dense_ms=t_rev[0], kernel_layout_ms=t_rev[1], linear_layout_ms=t_rev[2]),
               drained=dict(dense_ms=t_sync[0], linear_layout_ms=t_sync[1], kernel_layout_ms=t_sync[2]),
               same_grads=same, grad_layout_kept=layout_kept, **info)
    records.append(rec)
    print(f"M {M} k {k} {dist} (rows past the width {rec['heavy_rows']}): dense {t[0]:.3f} ms, sparse (nn.Linear layout) {t[1]:.3f} ({t[0] / t[1]:.2f}x), "
          f"sparse (kernel layout) {t[2]:.3f} ({t[0] / t[2]:.2f}x); grads equal {same}, grad layout kept {layout_kept}", flush=True)
    print(f"  kernel layout timed first: dense {t_rev[0]:.3f}, kernel {t_rev[1]:.3f}, linear {t_rev[2]:.3f}; "
          f"GPU drained before each call: dense {t_sync[0]:.3f}, linear {t_sync[1]:.3f}, kernel {t_sync[2]:.3f}", flush=True)
    if str(k) in os.environ.get("PROFILE_K", "").split(",") and not SMOKE:
        # where the two layouts' time goes, kernel by kernel (10 calls each)
        from torch.profiler import ProfilerActivity, profile

        for name, w in (("nn.Linear layout", wd), ("kernel layout", wd_k)):
            fn = sparse(w)
            fn()
            torch.cuda.synchronize()
            cpu = os.environ.get("PROFILE_CPU") == "1"  # also the host's side: where a call waits
            acts = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
            with profile(activities=acts) as prof:
                for _ in range(10):
                    fn()
                torch.cuda.synchronize()
            table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60)
            if cpu:
                table += "\n" + prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=20,
                                                          max_name_column_width=60)
            print(f"--- M {M} k {k}, {name}, 10 calls\n{table}", flush=True)
            with open(os.path.join(OUT, f"profile_M{M}_k{k}_{name.split()[0].replace('.', '')}.txt"), "w") as fh:
                fh.write(table)
    del s, x, wg, wu, wd, wd_k, dy, params

with open(os.path.join(OUT, "train_layout_probe.json"), "w") as fh:
    json.dump({"records": records}, fh, indent=1)
