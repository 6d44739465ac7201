"""Device experiment: the split up/down kernels and the bit-word pack against the shipped ones.

Usage (GPU machine, repository root): python benchmarks/split_variants.py OUTDIR
Times, at M = 131072, d = 2048, f = 5632, bf16, even units: the pack pass (scan vs bits, several
block shapes), the up pass, the down pass by slices of d (several block shapes), the fused token
kernel, and whole pipelines against dense; checks every variant's output first. Writes
OUTDIR/split_variants.json and prints a short table last.
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch
import triton

from twell.bench.inference import bench_ms, dense_gated, errors, machine_info, reference_fp32
from twell.bench.synthetic import make_ffn
from twell.kernels import OverflowCounters, ffn_from_twell, pack_relu
from twell.kernels import updown
from twell.kernels.split import down_kernel, up_kernel
from twell.ops import default_tile, prepare_gated_weights

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
SMOKE = os.environ.get("TWELL_SMOKE") == "1"  # CPU check of this script under TRITON_INTERPRET=1
M, d, f = (96, 64, 300) if SMOKE else (131072, 2048, 5632)
DEV = "cpu" if SMOKE else "cuda"
DT = torch.float16 if SMOKE else torch.bfloat16  # the interpreter has no bf16 arithmetic
TILE = default_tile(f)
if SMOKE:
    def bench_ms(fn):  # noqa: F811
        fn()
        return 1.0
info = machine_info()
records = []


def add(**kw):
    kw.update(info)
    records.append(kw)
    print("  ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in kw.items() if a not in info), flush=True)


def run_up(x, g, h, w, cfg):
    be, nw = cfg
    up_kernel[(M,)](x, x.stride(0), g.counts, g.values, g.cols, h, w.up, w.up.stride(0), M, d, g.slots,
                    D=triton.next_power_of_2(d), BE=be, num_warps=nw)


def run_down(g, h, w, y, cfg):
    bt, be, ds, nw = cfg
    n_tb = triton.cdiv(M, bt)
    down_kernel[(n_tb * triton.cdiv(d, ds),)](
        g.counts, h, g.cols, w.down_t, w.down_t.stride(0), y, y.stride(0), g.counts, g.counts,
        M, d, g.slots, n_tb, BT=bt, BE=be, DS=ds, TRACK=False, num_warps=nw)


t_start = time.time()
for k in ((29, 56, 8) if not SMOKE else (29,)):
    s = make_ffn(M, d, f, k, "even", dtype=DT, device=DEV, seed=7)
    x, wg = s.x, s.w_gate
    w = prepare_gated_weights(s.w_up, s.w_down)
    ref = reference_fp32(x, wg, s.w_up, s.w_down)
    dense_ms = bench_ms(lambda: dense_gated(x, wg, s.w_up, s.w_down))
    add(variant="dense", k=k, ms=dense_ms)
    pre = torch.mm(x, wg.T)
    if k == 29:
        add(variant="gate", k=k, ms=bench_ms(lambda: torch.mm(x, wg.T)))
    # pack: scan (shipped) vs bits
    g = pack_relu(pre, TILE, 8)
    add(variant="pack_scan", k=k, cfg="4x256x2", ms=bench_ms(lambda: pack_relu(pre, TILE, 8)))
    pack_cfgs = [(4, 256, 2), (8, 256, 4), (16, 256, 4), (8, 512, 4), (16, 512, 8), (32, 256, 4), (32, 256, 8), (16, 1024, 8)] if k != 8 else [(8, 256, 4), (16, 256, 4)]
    for cfg in pack_cfgs:
        gb = pack_relu(pre, TILE, 8, method="bits", config=cfg)
        valid = torch.arange(g.slots, device=DEV)[None, :] < g.counts.clamp(max=g.slots)
        same = bool(torch.equal(gb.counts, g.counts)) and bool(torch.equal(gb.cols[:, 0][valid], g.cols[:, 0][valid])) and bool(torch.equal(gb.values[:, 0][valid], g.values[:, 0][valid]))
        add(variant="pack_bits", k=k, cfg="x".join(map(str, cfg)), same=same, ms=bench_ms(lambda: pack_relu(pre, TILE, 8, method="bits", config=cfg)))
    pairs = float(g.counts.clamp(max=g.slots).sum())
    c = OverflowCounters.zeros(x.device)
    tok_ms = bench_ms(lambda: ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre, counters=c, kernel="token"))
    add(variant="updown_token", k=k, cfg="2x2", ms=tok_ms, pair_TBps=pairs * 8 * d / tok_ms / 1e9)
    h = torch.empty_like(g.values)
    up_cfgs = [(2, 2), (4, 4), (4, 2), (8, 4), (2, 1), (1, 1)] if k != 8 else [(2, 2), (4, 4)]
    best_up = None
    for cfg in up_cfgs:
        ms = bench_ms(lambda: run_up(x, g, h, w, cfg))
        add(variant="up", k=k, cfg="x".join(map(str, cfg)), ms=ms, pair_TBps=pairs * 2 * d / ms / 1e9)
        best_up = min(best_up or (ms, cfg), (ms, cfg))
    run_up(x, g, h, w, best_up[1])
    y = torch.full((M, d), float("nan"), dtype=DT, device=DEV)
    down_cfgs = [(16, 8, 16, 4), (32, 8, 16, 4), (16, 16, 16, 4), (16, 4, 16, 2), (8, 8, 16, 2), (32, 4, 16, 4),
                 (16, 8, 8, 4), (32, 8, 8, 4), (16, 8, 32, 4), (32, 8, 32, 8), (64, 4, 16, 4), (16, 8, 64, 4)] if k != 8 else [(16, 8, 16, 4), (32, 8, 16, 4)]
    best_down = None
    for cfg in down_cfgs:
        y.fill_(float("nan"))
        run_down(g, h, w, y, cfg)
        e = errors(y, ref)  # overflowed rows (none at even k) would be wrong here
        ms = bench_ms(lambda: run_down(g, h, w, y, cfg))
        add(variant="down", k=k, cfg="x".join(map(str, cfg)), ms=ms, rel_err=e[0], max_row_err=e[1], pair_TBps=pairs * 2 * d / ms / 1e9)
        best_down = min(best_down or (ms, cfg), (ms, cfg))
    # whole pipelines
    split_cfg = best_up[1] + best_down[1]
    best_pack = min((r["ms"], r["cfg"]) for r in records if r.get("variant") == "pack_bits" and r.get("k") == k and r.get("same"))
    pcfg = tuple(int(v) for v in best_pack[1].split("x"))

    def pipeline_split():
        p = torch.mm(x, wg.T)
        gg = pack_relu(p, TILE, 8, method="bits", config=pcfg)
        return ffn_from_twell(x, gg, w.down_t, w_up=w.up, pre=p, counters=c, kernel="split", split_config=split_cfg)

    def pipeline_token():
        p = torch.mm(x, wg.T)
        gg = pack_relu(p, TILE, 8)
        return ffn_from_twell(x, gg, w.down_t, w_up=w.up, pre=p, counters=c, kernel="token")

    for name, fn in (("pipeline_token", pipeline_token), ("pipeline_split", pipeline_split)):
        yy = fn()
        e = errors(yy, ref)
        ms = bench_ms(fn)
        dms = bench_ms(lambda: dense_gated(x, wg, s.w_up, s.w_down))
        add(variant=name, k=k, cfg=f"pack {best_pack[1]} split {split_cfg}", ms=ms, dense_ms=dms, speedup=dms / ms, rel_err=e[0], max_row_err=e[1])
    del s, x, wg, w, ref, pre, g, h, y
    torch.cuda.empty_cache()
    print(f"-- k={k} done at {time.time() - t_start:.0f}s", flush=True)

with open(f"{out_dir}/split_variants.json", "w") as fh:
    json.dump(records, fh, indent=1)
print("\nvariant            k   cfg                          ms      speedup")
for r in records:
    if r["variant"].startswith("pipeline") or r["variant"] in ("dense", "gate", "pack_scan", "updown_token"):
        print(f"{r['variant']:18} {r['k']:3} {str(r.get('cfg', '')):28} {r['ms']:7.3f} {r.get('speedup', float('nan')):6.2f}")
for v in ("pack_bits", "up", "down"):
    for k in (29, 56):
        rs = [r for r in records if r["variant"] == v and r["k"] == k]
        if rs:
            b = min(rs, key=lambda r: r["ms"])
            print(f"best {v:13} {k:3} {b['cfg']:28} {b['ms']:7.3f}")
