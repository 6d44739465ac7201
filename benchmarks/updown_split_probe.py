"""Device experiment: the inference up/down from TwELL, fused (``kernel="token"``, at the fused
shape ``updown.default_config`` gives for the case's k) against the split path (``kernel="split"``: up products, then
down rows, two launches) at a few (entries per step, warps) shapes. bf16, d 2048, f 5632 (or
SHAPE, at MS tokens and KS units, default 16384,65536 and 29,56), the module's TwELL (cuBLAS
gate, ``pack_relu``); three interleaved rounds, medians.

    python benchmarks/updown_split_probe.py [OUTDIR]
    SHAPE=4096x11008 MS=16384,65536 KS=29,56 python benchmarks/updown_split_probe.py [OUTDIR]

With SHAPE set, the fused kernel is timed at several shapes too (TOKEN_SHAPES). The thirty-third
session's run at d 4096 set that width's shapes (``updown.TUNED``, ``SPLIT_CONFIG``,
``SPLIT_NARROW``) and its split threshold (``SPLIT_MIN_M_BY_D``): the module now takes the split
path there from 4096 tokens, so the first column is no longer what the module runs at d 4096.

Writes OUTDIR/updown_split_probe_D.json; prints the table last.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from twell.bench.inference import bench_ms, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import OverflowCounters, ffn_from_twell, pack_relu, updown
from twell.ops import DEFAULT_COMPRESSION, default_tile, prepare_gated_weights

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
D, F = (int(v) for v in os.environ.get("SHAPE", "2048x5632").split("x"))
if "SHAPE" in os.environ:
    CASES = [(int(M), int(k), "even") for M in os.environ.get("MS", "16384,65536").split(",")
             for k in os.environ.get("KS", "29,56").split(",")]
    TOKEN_SHAPES = [(2, 4), (4, 4), (2, 8), (4, 8), (8, 8)]
else:
    CASES = [(M, k, "even") for M in (4096, 16384, 131072) for k in (8, 29, 56)] + [(131072, 29, "skewed"), (131072, 29, "heavy")]
    TOKEN_SHAPES = []
SHAPES = [(1, 4), (2, 4), (1, 2), (2, 2), (1, 8), (4, 4), (2, 8), (4, 8)]


def twell_case(M: int, k: float, dist: str, device: str = "cuda", **make_kw):
    """One case as the module's prefill path sees it (shared with split_spread_probe.py and
    exact_launch_probe.py): ``(s, w, pre, g, per_row)``, the synthetic FFN (bf16, d D, f F),
    its prepared weights, the cuBLAS gate's pre-activation, its TwELL (``pack_relu``) and the
    active units per row (float64)."""
    s = make_ffn(M, D, F, k, dist, torch.bfloat16, device, seed=M + int(k) + D, **make_kw)
    w = prepare_gated_weights(s.w_up, s.w_down)
    pre = torch.mm(s.x, s.w_gate.T)
    g = pack_relu(pre, default_tile(F), DEFAULT_COMPRESSION)
    return s, w, pre, g, g.counts.sum(1).double()


def main() -> None:
    recs = []
    with torch.no_grad():
        for M, k, dist in CASES:
            s, w, pre, g, per_row = twell_case(M, k, dist)
            k_mean = float(per_row.mean())
            tok = updown.default_config(D, k_mean)
            c = OverflowCounters.zeros("cuda")
            variants = {f"token {tok[0]}x{tok[1]}": dict(kernel="token", block_e=tok[0], num_warps=tok[1])}
            variants.update({f"token {be}x{nw}": dict(kernel="token", block_e=be, num_warps=nw)
                             for be, nw in TOKEN_SHAPES if (be, nw) != tok})
            variants.update({f"split {be}x{nw}": dict(kernel="split", block_e=be, num_warps=nw) for be, nw in SHAPES})
            ref = ffn_from_twell(s.x, g, w.down_t, w_up=w.up, pre=pre, counters=c, kernel="token", block_e=1, num_warps=4)
            same = bool(torch.equal(ffn_from_twell(s.x, g, w.down_t, w_up=w.up, pre=pre, counters=c, kernel="split",
                                                   block_e=1, num_warps=4), ref))
            times = {n: [] for n in variants}
            for _ in range(3):
                for n, kw in variants.items():
                    times[n].append(bench_ms(lambda kw=kw, s=s, g=g, w=w, pre=pre: ffn_from_twell(s.x, g, w.down_t, w_up=w.up, pre=pre, counters=c, **kw), rep=50))
            ms = {n: sorted(t)[1] for n, t in times.items()}
            best = min((n for n in ms if n.startswith("split")), key=ms.get)
            rec = dict(M=M, k=k, dist=dist, k_mean=k_mean, split_equals_token_1x4=same, ms=ms, rounds=times, best_split=best)
            recs.append(rec)
            print(f"M {M} k {k} {dist} (k mean {k_mean:.1f}): " + ", ".join(f"{n} {v:.3f}" for n, v in ms.items())
                  + f" | best {best}, same {same}", flush=True)
            del s, w, pre, g
            torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, f"updown_split_probe_{D}.json"), "w") as fh:
        json.dump(dict(machine_info(), records=recs), fh, indent=1)
    print("\ncase                    token (default fused)    best split        ratio")
    for r in recs:
        tn = next(n for n in r["ms"] if n.startswith("token"))
        bt = min((n for n in r["ms"] if n.startswith("token")), key=r["ms"].get)
        print(f"M {r['M']:6d} k {r['k']:2d} {r['dist']:6s}  {tn} {r['ms'][tn]:.3f}   {r['best_split']} {r['ms'][r['best_split']]:.3f}"
              f"   {r['ms'][tn] / r['ms'][r['best_split']]:.3f}x   best token {bt} {r['ms'][bt]:.3f}")


if __name__ == "__main__":
    main()
