"""Probe: the hottest units of a layer as a small dense block, the rest through TwELL.

A unit that fires for a share p of the tokens costs one (token, unit) gather of 8 KB of weight
rows per firing on the kernel path (about 1 ns each at 131072 tokens on the H200), against about
4 d flops on tensor cores for every token as a dense column (about 0.012 ns at 700 TFLOP/s).
Past p of about 1% a dense column is cheaper. Skewed layers (the synthetic ``skewed`` units,
trained models) have a few units that fire for a large share of tokens.

This probe emulates the design without changing a kernel: the units are permuted so that the nh
most frequent ones (counted on the first 4096 rows) are the last nh columns; the gate is one
cuBLAS product over all f columns; the first f - nh columns go through the shipped pack and
up/down (``pre_writable``, the module's launch shape); the last nh as
``y += (relu(pre_hot) * (x w_up_hot^T)) w_down_hot^T`` (two cuBLAS products, one elementwise
pass, the second product adding into y). Timed against dense PyTorch and the module (default
settings, track_stats off) in three alternating rounds, L2 flushed (``bench_ms``).

    python benchmarks/hot_units_probe.py OUTDIR
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from twell import SparseGatedMLP
from twell.bench.inference import bench_ms, dense_gated, errors, machine_info, reference_fp32
from twell.bench.synthetic import make_ffn
from twell.kernels import OverflowCounters, ffn_from_twell, pack_relu, updown
from twell.kernels.elementwise import relu_mul_
from twell.ops import DEFAULT_COMPRESSION, default_tile, prepare_gated_weights

OUT = sys.argv[1]
DRY = os.environ.get("PROBE_DRY") == "1"  # CPU check of the arithmetic (TRITON_INTERPRET=1), no timing
DEV = "cpu" if DRY else "cuda"
CASES = [(131072, 29, "skewed"), (131072, 56, "skewed"), (16384, 29, "skewed"), (131072, 29, "even")]
HOT = [0, 64, 128, 256, 512]
d, f = 2048, 5632
if DRY:
    CASES, HOT, d, f = [(300, 6, "skewed")], [0, 8], 64, 200
    updown.TWO_PASS_MIN_M, updown.SPLIT_MIN_M = 64, 64  # the dense-rows and split launches at a small M
    bench_ms = lambda fn, rep=0: (fn(), 1.0)[1]  # noqa: E731
records = []
for M, k, dist in CASES:
    s = make_ffn(M, d, f, k, dist, dtype=torch.bfloat16, device=DEV, seed=int(k) + M + d)
    x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
    ref = reference_fp32(x, wg, wu, wd)
    with torch.no_grad():
        freq = (x[:4096] @ wg.T > 0).sum(0)
        order = torch.argsort(freq, descending=True, stable=True)
        mod = SparseGatedMLP(d, f, device=DEV, dtype=torch.bfloat16).eval()
        mod.gate_proj.weight.copy_(wg)
        mod.up_proj.weight.copy_(wu)
        mod.down_proj.weight.copy_(wd)
        mod.track_stats = False
        for _ in range(3):
            mod(x)
        fns = {"dense": lambda: dense_gated(x, wg, wu, wd), "module": lambda: mod(x)}
        info = {}
        for nh in HOT:
            hot = order[:nh]
            cold = torch.sort(order[nh:]).values
            perm = torch.cat([cold, hot])
            fc = f - nh
            wg_p = wg[perm].contiguous()
            w = prepare_gated_weights(wu[cold].contiguous(), wd[:, cold].contiguous())
            up_h = wu[hot].contiguous()
            down_h = wd[:, hot].contiguous()  # [d, nh]
            tile = default_tile(fc)
            pre0 = torch.mm(x, wg_p.T)
            g0 = pack_relu(pre0[:, :fc], tile, DEFAULT_COMPRESSION)
            nnz = g0.counts.sum(1, dtype=torch.int64).float()
            mean_k, rms_k = float(nnz.mean()), float(nnz.pow(2).mean().sqrt())
            split = updown.splits(M, True, d=d)
            be, nw = updown.default_config(d, mean_k, split=split, rms_k=rms_k)
            c = OverflowCounters.zeros(x.device)

            def run(nh=nh, fc=fc, wg_p=wg_p, w=w, up_h=up_h, down_h=down_h, tile=tile, be=be, nw=nw, c=c):
                pre = torch.mm(x, wg_p.T)
                pc = pre[:, :fc]
                g = pack_relu(pc, tile, DEFAULT_COMPRESSION)
                y = ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pc, counters=c, block_e=be, num_warps=nw, pre_writable=True)
                if nh:
                    u = torch.mm(x, up_h.T)
                    relu_mul_(u, pre[:, fc:].contiguous())
                    y.addmm_(u, down_h.T)
                return y

            y = run()
            rel, row = errors(y, ref)
            info[nh] = dict(cold_mean_k=mean_k, cold_rms_k=rms_k, hot_share=1 - mean_k / max(float(freq.sum()) / min(M, 4096), 1e-9),
                            rel_err=rel, max_row_err=row, config=f"{be}x{nw}", split=split)
            fns[f"hot{nh}"] = run
            if nh == 256 or (nh == 0 and M == 16384):
                # the hot block's stages alone
                pre = pre0
                info[nh]["gate_ms"] = bench_ms(lambda: torch.mm(x, wg_p.T))
                info[nh]["pack_ms"] = bench_ms(lambda: pack_relu(pre[:, :fc], tile, DEFAULT_COMPRESSION))
                info[nh]["updown_ms"] = bench_ms(lambda: ffn_from_twell(x, g0, w.down_t, w_up=w.up, pre=pre[:, :fc], counters=c,
                                                                       block_e=be, num_warps=nw, pre_writable=True))
                if nh:
                    yy = torch.empty_like(x)

                    def hot_part():
                        u = torch.mm(x, up_h.T)
                        relu_mul_(u, pre[:, fc:].contiguous())
                        yy.addmm_(u, down_h.T)

                    info[nh]["hot_ms"] = bench_ms(hot_part)
            del pre0, g0
        y_mod = mod(x)
        rel_m, row_m = errors(y_mod, ref)
        rel_d, row_d = errors(dense_gated(x, wg, wu, wd), ref)
        rounds = {name: [] for name in fns}
        for _ in range(3):
            for name, fn in fns.items():
                rounds[name].append(bench_ms(fn, rep=60))
    med = {name: statistics.median(v) for name, v in rounds.items()}
    rec = dict(M=M, d=d, f=f, k=k, distribution=dist, ms=med, rounds=rounds, hot=info, module_rel_err=rel_m,
               module_max_row_err=row_m, dense_rel_err=rel_d, dense_max_row_err=row_d, module_path=mod.last_path, **machine_info())
    records.append(rec)
    line = " ".join(f"{n} {med[n]:.3f} ({med['dense'] / med[n]:.2f}x)" for n in med)
    print(f"M {M} k {k} {dist}: {line}", flush=True)
    for nh, i in info.items():
        print(f"   hot {nh}: cold k {i['cold_mean_k']:.1f} rms {i['cold_rms_k']:.1f} share {i['hot_share']:.2f} err {i['rel_err']:.1e} "
              f"row {i['max_row_err']:.1e} (dense {row_d:.1e}) " + " ".join(f"{s_} {i[s_]:.3f}" for s_ in ("gate_ms", "pack_ms", "updown_ms", "hot_ms") if s_ in i), flush=True)
    del s, x, wg, wu, wd, ref, mod, fns
    if not DRY:
        torch.cuda.empty_cache()
with open(os.path.join(OUT, "hot_units_probe.json"), "w") as fh:
    json.dump(records, fh, indent=1)
