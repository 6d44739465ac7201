"""Device experiment: the prefill FFN with the pack folded into the up/down kernel (each token's
program scans its own row of the pre-activation, `twell.kernels.updown_scan.ffn_from_pre`)
against the shipped cuBLAS gate + pack + up/down, and dense.

Usage (GPU machine, repository root): OUT=dir python benchmarks/scan_updown_probe.py
Env: CASES="M:k:dist,..." (default below), CONFIGS="ch:be:warps,..." (scan kernel shapes).
bf16, d 2048, f 5632; each variant checked against an fp32 reference (relative error, worst
row over the median row norm) and timed by do_bench (L2 flushed before each call, medians),
in turn: dense, shipped, then each scan shape; the whole FFN (gate included) and the sparse
steps alone (pack + up/down against the scan kernel). Writes OUT/scan_updown_probe.json.
"""

from __future__ import annotations

import json
import os

import torch

from twell.bench.inference import bench_ms, dense_gated, errors, machine_info, reference_fp32
from twell.bench.synthetic import make_ffn
from twell.kernels import OverflowCounters, ffn_from_twell, pack_relu
from twell.kernels.updown_scan import ffn_from_pre
from twell.ops import default_tile

OUT = os.environ.get("OUT", ".")
SMOKE = os.environ.get("TWELL_SMOKE") == "1"  # CPU check of this script under TRITON_INTERPRET=1
d, f = (64, 300) if SMOKE else (2048, 5632)
DEV = "cpu" if SMOKE else "cuda"
DT = torch.float16 if SMOKE else torch.bfloat16
TILE = default_tile(f)
if SMOKE:
    def bench_ms(fn):  # noqa: F811
        fn()
        return 1.0

default_cases = "131072:29:even,131072:8:even,131072:56:even,131072:29:skewed,131072:29:heavy,16384:29:even,4096:29:even"
CASES = [(int(M), float(k), dist) for M, k, dist in (c.split(":") for c in os.environ.get("CASES", default_cases).split(","))]
if SMOKE:
    CASES = [(96, 20, "even"), (96, 20, "heavy")]
CONFIGS = [tuple(int(v) for v in c.split(":")) for c in os.environ.get("CONFIGS", "1024:4:4,512:4:4,2048:4:4,1024:2:2,1024:4:2,1024:2:4").split(",")]
info = machine_info()
records = []


def add(**kw):
    records.append(dict(kw, **info))
    print("  ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in kw.items()), flush=True)


with torch.no_grad():
    for M, k, dist in CASES:
        s = make_ffn(M, d, f, k, dist, dtype=DT, device=DEV, seed=7)
        x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
        wd_t = wd.T.contiguous()
        ref = reference_fp32(x, wg, wu, wd)
        dense_ms = bench_ms(lambda: dense_gated(x, wg, wu, wd))
        rel_d, row_d = errors(dense_gated(x, wg, wu, wd), ref)
        pre = torch.mm(x, wg.T)
        mean_k = float((pre > 0).sum(dim=1, dtype=torch.float32).mean())

        def shipped():
            p = torch.mm(x, wg.T)
            g = pack_relu(p, TILE, 8)
            return ffn_from_twell(x, g, wd_t, w_up=wu, pre=p)

        def shipped_sparse():
            g = pack_relu(pre, TILE, 8)
            return ffn_from_twell(x, g, wd_t, w_up=wu, pre=pre)

        y0 = shipped()
        rel, row = errors(y0, ref)
        base = dict(M=M, k=k, dist=dist, mean_k=mean_k, dense_ms=dense_ms, dense_rel_err=rel_d, dense_max_row_err=row_d)
        ms = bench_ms(shipped)
        add(variant="shipped", **base, ms=ms, speedup=dense_ms / ms, sparse_ms=bench_ms(shipped_sparse),
            pack_ms=bench_ms(lambda: pack_relu(pre, TILE, 8)), rel_err=rel, max_row_err=row)
        for cfg in CONFIGS:
            c = OverflowCounters.zeros(x.device)
            y = ffn_from_pre(x, pre, wd_t, w_up=wu, config=cfg, counters=c,
                             out=torch.full_like(x, float("nan")))
            rel, row = errors(y, ref)
            same = bool(torch.equal(y, y0))
            ms = bench_ms(lambda: ffn_from_pre(x, torch.mm(x, wg.T), wd_t, w_up=wu, config=cfg))
            sp = bench_ms(lambda: ffn_from_pre(x, pre, wd_t, w_up=wu, config=cfg))
            add(variant="scan", cfg=":".join(map(str, cfg)), **base, ms=ms, speedup=dense_ms / ms, sparse_ms=sp,
                rel_err=rel, max_row_err=row, same_as_shipped=same, overflow_rows=int(c.rows))
        del s, x, wg, wu, wd, wd_t, ref, pre, y0
        torch.cuda.empty_cache() if DEV == "cuda" else None

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "scan_updown_probe.json"), "w") as fh:
    json.dump({"records": records}, fh, indent=1)
print("\nM       k   dist    dense   shipped(sparse)      best scan(sparse) cfg")
for M, k, dist in CASES:
    rs = [r for r in records if (r["M"], r["k"], r["dist"]) == (M, k, dist)]
    sh = next(r for r in rs if r["variant"] == "shipped")
    sc = min((r for r in rs if r["variant"] == "scan"), key=lambda r: r["ms"])
    print(f"{M:<7} {k:<3g} {dist:<7} {sh['dense_ms']:.3f}  {sh['ms']:.3f} ({sh['sparse_ms']:.3f}) {sh['speedup']:.2f}x   "
          f"{sc['ms']:.3f} ({sc['sparse_ms']:.3f}) {sc['speedup']:.2f}x {sc['cfg']} err {sc['rel_err']:.1e}/{sc['max_row_err']:.2f}")
