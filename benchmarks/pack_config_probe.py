"""Device experiment: the pack passes' launch shapes by batch size (inference's bit-word pack at
4096 to 131072 tokens, training's ELL pack at 16384) and the up/down kernel's shape by batch size
and, with MODE=updown_k, by active units per token and distribution. (Its first run also timed
the prefill FFN with the pack folded into the up/down kernel at 4096 to 16384 tokens: that
kernel lost and is gone, see commit 056396a and benchmarks/NOTES_inference.md.)

Usage (GPU machine, repository root): OUT=dir python benchmarks/pack_config_probe.py
bf16, d 2048, f 5632, k 29 even; do_bench medians (L2 flushed). Every pack variant is checked
against the shipped shape's output. Writes OUT/pack_config_probe.json; short table last.
"""

from __future__ import annotations

import itertools
import json
import os

import torch

from twell.bench.inference import bench_ms, dense_gated, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import ffn_from_twell, pack_relu
from twell.kernels.gate_pack import PACK_BITS_CONFIG
from twell.kernels.train_ffn import pack_rows
from twell.kernels.updown import TUNED
from twell.ops import default_tile
from twell.train_ops import PACK_CONFIG

OUT = os.environ.get("OUT", ".")
SMOKE = os.environ.get("TWELL_SMOKE") == "1"
d, f = (64, 300) if SMOKE else (2048, 5632)
DEV, DT = ("cpu", torch.float16) if SMOKE else ("cuda", torch.bfloat16)
TILE = default_tile(f)
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
    valid = torch.arange(a.slots, device=a.counts.device)[None, :] < torch.where(a.counts > a.slots, 0, a.counts)
    return bool(torch.equal(a.counts, b.counts)) and bool(torch.equal(a.cols[:, 0][valid], b.cols[:, 0][valid]))


Ms = (96,) if SMOKE else (4096, 8192, 16384, 131072)
if os.environ.get("MODE") == "updown_k":  # second run: up/down shapes over k and distributions
    Ms = ()
    cases = [(96, 8, "even")] if SMOKE else [
        (131072, 8, "even"), (131072, 56, "even"), (131072, 29, "skewed"), (131072, 56, "skewed"), (131072, 29, "heavy"),
        (16384, 8, "even"), (16384, 56, "even"), (4096, 56, "even")]
    with torch.no_grad():
        for M, k, dist in cases:
            s = make_ffn(M, d, f, k, dist, dtype=DT, device=DEV, seed=7)
            x, wu, wd_t = s.x, s.w_up, s.w_down.T.contiguous()
            pre = torch.mm(x, s.w_gate.T)
            g = pack_relu(pre, TILE, 8)
            mean_k = float((pre > 0).sum(dim=1, dtype=torch.float32).mean())
            for be, nw in [(4, 4), (2, 4), (2, 2), (4, 2)]:
                ms = bench_ms(lambda: ffn_from_twell(x, g, wd_t, w_up=wu, pre=pre, block_e=be, num_warps=nw))
                add(variant="updown_k", M=M, k=k, dist=dist, mean_k=mean_k, cfg=f"{be}x{nw}", ms=ms)
            del s, x, wu, wd_t, pre, g
            if DEV == "cuda":
                torch.cuda.empty_cache()
with torch.no_grad():
    for M in Ms:
        s = make_ffn(M, d, f, 29, "even", dtype=DT, device=DEV, seed=7)
        x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
        wd_t = wd.T.contiguous()
        pre = torch.mm(x, wg.T)
        ref = pack_relu(pre, TILE, 8)
        dense_ms = bench_ms(lambda: dense_gated(x, wg, wu, wd))
        gate_ms = bench_ms(lambda: torch.mm(x, wg.T))
        add(variant="dense", M=M, ms=dense_ms, gate_ms=gate_ms)
        shapes = [(bm, bn, nw) for bm, bn, nw in itertools.product((1, 2, 4, 8), (256, 512), (1, 2, 4))]
        if M == 131072:
            shapes = [PACK_BITS_CONFIG, (4, 256, 2), (2, 256, 1), (4, 256, 1), (2, 256, 2), (4, 512, 2)]
        best = (float("inf"), None)
        for cfg in shapes:
            g = pack_relu(pre, TILE, 8, config=cfg)
            ok = same_twell(g, ref)
            ms = bench_ms(lambda: pack_relu(pre, TILE, 8, config=cfg))
            add(variant="pack", M=M, cfg="x".join(map(str, cfg)), shipped=cfg == PACK_BITS_CONFIG, same=ok, ms=ms)
            if ok and ms < best[0]:
                best = (ms, cfg)
        g = pack_relu(pre, TILE, 8, config=best[1])
        for be, nw in [(4, 4), (2, 2), (2, 4), (4, 2), (1, 1), (2, 1), (1, 2)]:
            ms = bench_ms(lambda: ffn_from_twell(x, g, wd_t, w_up=wu, pre=pre, block_e=be, num_warps=nw))
            add(variant="updown", M=M, cfg=f"{be}x{nw}", shipped=(be, nw) == TUNED[2048], ms=ms)
        if M == 16384 or SMOKE:
            a = pre.float() if SMOKE else pre
            c0, v0, n0 = pack_rows(a, 64, **PACK_CONFIG)
            for bm, bf, nw in itertools.product((1, 2, 4, 8), (128, 256, 512, 1024), (1, 2, 4, 8)):
                if bm * bf > 8192:
                    continue
                c, v, n = pack_rows(a, 64, block_m=bm, block_f=bf, num_warps=nw)
                ok = bool(torch.equal(c, c0)) and bool(torch.equal(n, n0)) and bool(torch.equal(v, v0))
                ms = bench_ms(lambda: pack_rows(a, 64, block_m=bm, block_f=bf, num_warps=nw))
                add(variant="train_pack", M=M, cfg=f"{bm}x{bf}x{nw}",
                    shipped=(bm, bf, nw) == (PACK_CONFIG["block_m"], PACK_CONFIG["block_f"], PACK_CONFIG["num_warps"]), same=ok, ms=ms)
        del s, x, wg, wu, wd, wd_t, pre, ref, g
        if DEV == "cuda":
            torch.cuda.empty_cache()

os.makedirs(OUT, exist_ok=True)
with open(os.path.join(OUT, "pack_config_probe.json"), "w") as fh:
    json.dump({"records": records}, fh, indent=1)
for r in records:
    if r["variant"] == "updown_k" and r["cfg"] == "4x4":
        rs = {q["cfg"]: q["ms"] for q in records if q["variant"] == "updown_k" and (q["M"], q["k"], q["dist"]) == (r["M"], r["k"], r["dist"])}
        print(f"updown M {r['M']} k {r['k']} {r['dist']} (mean {r['mean_k']:.1f}): " + "  ".join(f"{c} {v:.4f}" for c, v in rs.items()))
print("\nvariant      M       shipped ms   best ms  best cfg")
for var in ("pack", "updown", "train_pack"):
    for M in Ms:
        rs = [r for r in records if r["variant"] == var and r["M"] == M and r.get("same", True)]
        if not rs:
            continue
        sh = next((r for r in rs if r.get("shipped")), None)
        b = min(rs, key=lambda r: r["ms"])
        print(f"{var:<12} {M:<7} {sh['ms'] if sh else float('nan'):9.4f}  {b['ms']:9.4f}  {b['cfg']}")
