"""Device experiment: how the bit-word pack writes its entries (issue 10).

`twell.kernels.gate_pack._pack_relu_bits_kernel` streams the pre-activation once into bit words
(phase 1), then writes the TwELL entries from the words (phase 2). EXTRACT 1 (shipped until this
probe) writes one entry of each row per step, a chain of dependent loads as long as the fullest
row; EXTRACT 2 writes them by rounds over all of a row's words at once; EXTRACT 0 writes none
(phase 1 alone). For each case: the pack's three ways at a few launch shapes, the cuBLAS gate,
a plain reduction over the pre-activation (the read it cannot avoid), and the whole FFN (gate,
pack, up/down) and the module (track_stats off) with EXTRACT 1 and 2 in alternation. Every
EXTRACT 2 output is checked against EXTRACT 1's (counts, columns and values of every
non-overflowed tile).

The variants need the kernel of commit 133a901 (its EXTRACT switch; the commit after it keeps
EXTRACT 3 alone): `git show 133a901:src/twell/kernels/gate_pack.py > src/twell/kernels/gate_pack.py`
first, on a scratch checkout.

Usage (GPU machine, repository root): OUT=dir python benchmarks/pack_extract_probe.py
bf16, d 2048, f 5632; do_bench medians (L2 flushed). Writes OUT/pack_extract_probe.json; short
table last. TWELL_SMOKE=1 runs a tiny case on the CPU (interpreter).
"""

from __future__ import annotations

import json
import os

import torch

from twell.bench.inference import bench_ms, dense_gated, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import ffn_from_twell, gate_pack, pack_relu
from twell.ops import DEFAULT_COMPRESSION, default_tile

OUT = os.environ.get("OUT", ".")
SMOKE = os.environ.get("TWELL_SMOKE") == "1"
d, f = (64, 300) if SMOKE else (2048, 5632)
DEV, DT = ("cpu", torch.float16) if SMOKE else ("cuda", torch.bfloat16)
TILE = default_tile(f)
if not hasattr(gate_pack, "PACK_EXTRACT"):  # later trees keep EXTRACT 3 alone: every variant would time it
    raise SystemExit("pack_extract_probe.py needs commit 133a901's gate_pack.py (see its docstring)")
DEFAULT_EXTRACT = gate_pack.PACK_EXTRACT
if SMOKE:
    def bench_ms(fn):  # noqa: F811
        fn()
        return 1.0
info = machine_info()
records = []


def add(**kw):
    records.append(dict(kw, **info))
    print("  ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in kw.items()), flush=True)


def same_twell(a, b):
    valid = torch.arange(a.slots, device=a.counts.device) < torch.where(a.overflowed(), 0, a.counts).unsqueeze(-1)
    return bool(torch.equal(a.counts, b.counts)) and bool(torch.equal(a.cols[valid], b.cols[valid])) \
        and bool(torch.equal(a.values[valid], b.values[valid]))


def packed(pre, extract, config=None):
    gate_pack.PACK_EXTRACT = extract
    try:
        return pack_relu(pre, TILE, DEFAULT_COMPRESSION, config=config)
    finally:
        gate_pack.PACK_EXTRACT = DEFAULT_EXTRACT


CASES = [(96, 8, "even")] if SMOKE else [
    (4096, 29, "even"), (8192, 29, "even"), (16384, 8, "even"), (16384, 29, "even"), (16384, 56, "even"),
    (131072, 8, "even"), (131072, 29, "even"), (131072, 56, "even"), (131072, 29, "skewed"), (131072, 29, "heavy")]
# (extract, shape) pairs timed per case; None = the default shape for M. Call 1 timed EXTRACT
# 0 / 1 / 2 at 2 to 8 rows per program: EXTRACT 2 lost by about 1 ms at 131072 rows and won at
# 4096 with one row per program. Call 2 adds EXTRACT 3 (the entries written as the pass streams).
SHAPES = [None, (1, 256, 1), (2, 256, 1), (4, 256, 2), (8, 256, 2)]
VARIANTS = [(1, None), (0, None), (2, None), (2, (1, 256, 1)), (0, (1, 256, 1))] + [(3, sh) for sh in SHAPES]
if SMOKE:
    VARIANTS = [(1, None), (0, None), (2, None), (3, None)]
ROUNDS = 1 if SMOKE else 2
summary = []
with torch.no_grad():
    for M, k, dist in CASES:
        s = make_ffn(M, d, f, k, dist, dtype=DT, device=DEV, seed=7)
        x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
        wd_t = wd.T.contiguous()
        pre = torch.mm(x, wg.T)
        ref = packed(pre, 1)
        mean_k = float((pre > 0).sum(dim=1, dtype=torch.float32).mean())
        row = dict(M=M, k=k, dist=dist, mean_k=mean_k)
        row["gate_ms"] = bench_ms(lambda: torch.mm(x, wg.T))
        row["read_ms"] = bench_ms(lambda: pre.sum(dtype=torch.float32))
        best3 = (float("inf"), None)
        for rnd in range(ROUNDS):
            for extract, shape in VARIANTS:
                ms = bench_ms(lambda: packed(pre, extract, shape))
                ok = same_twell(packed(pre, extract, shape), ref) if extract and rnd == 0 else None
                add(variant="pack", M=M, k=k, dist=dist, mean_k=mean_k, shape=str(shape or "default"), extract=extract,
                    round=rnd, ms=ms, same=ok)
                key = f"pack{extract}" + ("" if shape is None else "_" + "x".join(map(str, shape)))
                row.setdefault(key + "_rounds", []).append(ms)
                row[key + "_ms"] = min(row[key + "_rounds"])
                if ok is not None:
                    row[key + "_same"] = ok
                if extract == 3 and ms < best3[0]:
                    best3 = (ms, shape)
        row["pack3_best"] = [best3[0], str(best3[1] or "default")]
        for rnd in range(3):
            for extract in (1, 3):
                def ffn():
                    p = torch.mm(x, wg.T)
                    return ffn_from_twell(x, packed(p, extract, best3[1] if extract == 3 else None), wd_t, w_up=wu, pre=p)
                ms = bench_ms(ffn)
                add(variant="ffn", M=M, k=k, dist=dist, extract=extract, shape=str(best3[1] if extract == 3 else "default"),
                    round=rnd, ms=ms)
                row.setdefault(f"ffn{extract}_rounds", []).append(ms)
        row["dense_ms"] = bench_ms(lambda: dense_gated(x, wg, wu, wd))
        y1 = ffn_from_twell(x, packed(pre, 1), wd_t, w_up=wu, pre=pre)
        y2 = ffn_from_twell(x, packed(pre, 3, best3[1]), wd_t, w_up=wu, pre=pre)
        row["ffn_equal"] = bool(torch.equal(y1, y2))
        summary.append(row)
        del s, x, wg, wu, wd, wd_t, pre, ref, y1, y2
        if DEV == "cuda":
            torch.cuda.empty_cache()

# the module as a user runs it (eval, track_stats off), EXTRACT 1 and 2 in alternation
mod_rows = []
try:
    from twell import SparseGatedMLP

    for M, k, dist in ([(96, 8, "even")] if SMOKE else [(4096, 29, "even"), (16384, 29, "even"), (131072, 29, "even"), (131072, 8, "even")]
                       if os.environ.get("MODULE") == "1" else []):
        s = make_ffn(M, d, f, k, dist, dtype=DT, device=DEV, seed=7)
        m = SparseGatedMLP(d, f, device=DEV, dtype=DT).eval()
        m.track_stats = False
        with torch.no_grad():
            m.gate_proj.weight.copy_(s.w_gate)
            m.up_proj.weight.copy_(s.w_up)
            m.down_proj.weight.copy_(s.w_down)
            for _ in range(3):  # let the layer's estimate arrive
                m(s.x)
                if DEV == "cuda":
                    torch.cuda.synchronize()
            r = dict(M=M, k=k, dist=dist, path=getattr(m, "last_path", None))
            for rnd in range(3):
                for extract in (1, 3):
                    gate_pack.PACK_EXTRACT = extract
                    r.setdefault(f"module{extract}_rounds", []).append(bench_ms(lambda: m(s.x)))
            gate_pack.PACK_EXTRACT = DEFAULT_EXTRACT
            r["dense_ms"] = bench_ms(lambda: dense_gated(s.x, s.w_gate, s.w_up, s.w_down))
        mod_rows.append(r)
        print(r, flush=True)
        del s, m
        if DEV == "cuda":
            torch.cuda.empty_cache()
except Exception as e:  # noqa: BLE001 - the kernel rows above are the point; say why this part failed
    print("module timing failed:", repr(e), flush=True)

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "pack_extract_probe.json"), "w") as fh:
    json.dump({"records": records, "summary": summary, "module": mod_rows, **info}, fh, indent=1)

med = lambda v: sorted(v)[len(v) // 2]  # noqa: E731
print(f"\n{'M':>7} {'k':>3} {'dist':>6} | {'gate':>6} {'read':>6} | {'pack1':>6} {'ph1':>6} {'pack2':>6} {'p2 r1':>6} {'pack3':>6} {'best3':>6} {'shape':>13} | {'ffn1':>6} {'ffn3':>6} {'dense':>6} | same")
for r in summary:
    print(f"{r['M']:>7} {r['k']:>3} {r['dist']:>6} | {r['gate_ms']:6.3f} {r['read_ms']:6.3f} | {r['pack1_ms']:6.3f} {r['pack0_ms']:6.3f} "
          f"{r['pack2_ms']:6.3f} {r.get('pack2_1x256x1_ms', float('nan')):6.3f} {r['pack3_ms']:6.3f} {r['pack3_best'][0]:6.3f} {r['pack3_best'][1]:>13} | "
          f"{med(r['ffn1_rounds']):6.3f} {med(r['ffn3_rounds']):6.3f} {r['dense_ms']:6.3f} | {r.get('pack3_same')} {r['ffn_equal']}")
for r in mod_rows:
    if "module1_rounds" in r:
        print(f"module M {r['M']} k {r['k']} {r['dist']}: extract1 {med(r['module1_rounds']):.3f} extract3 {med(r['module3_rounds']):.3f} "
              f"dense {r['dense_ms']:.3f} ms")
