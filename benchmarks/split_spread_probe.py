"""Device experiment: which (entries per step, warps) the inference split path should take, by
how unequal the rows are. At 131072 tokens (bf16, d 2048, f 5632, the module's TwELL: cuBLAS
gate, ``pack_relu``) the split up/down (``kernel="split"``) at 1 x 2, 1 x 4, 2 x 2 and 4 x 4
against the fused kernels at the module's shape, on evenly spread and skewed units and on
heavy rows whose token scales are log-normal with sigma 0.05 to 0.6 (``make_ffn``'s
``heavy_sigma``): each case records the root mean square of the active units per token over
their mean (the spread the module's probe measures), three interleaved rounds, medians.

    python benchmarks/split_spread_probe.py [OUTDIR]

Writes OUTDIR/split_spread_probe.json; prints the table last.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from twell.bench.inference import bench_ms, machine_info
from twell.kernels import OverflowCounters, ffn_from_twell, updown
from updown_split_probe import twell_case

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
M, D, F = 131072, 2048, 5632
CASES = ([(k, "even", None) for k in (8, 16, 29, 56)] + [(29, "skewed", None), (56, "skewed", None)]
         + [(29, "heavy", s) for s in (0.05, 0.1, 0.15, 0.2, 0.3, 0.6)])
SHAPES = [(1, 2), (1, 4), (2, 2), (4, 4)]


def main() -> None:
    recs = []
    with torch.no_grad():
        for k, dist, sigma in CASES:
            s, w, pre, g, nnz = twell_case(M, k, dist, **({} if sigma is None else dict(heavy_sigma=sigma)))
            k_mean, k_rms = float(nnz.mean()), float(nnz.pow(2).mean().sqrt())
            tok = updown.default_config(D, k_mean)
            c = OverflowCounters.zeros("cuda")
            variants = {f"token {tok[0]}x{tok[1]}": dict(kernel="token", block_e=tok[0], num_warps=tok[1])}
            variants.update({f"split {be}x{nw}": dict(kernel="split", block_e=be, num_warps=nw) for be, nw in SHAPES})
            times = {n: [] for n in variants}
            for _ in range(3):
                for n, v in variants.items():
                    times[n].append(bench_ms(lambda v=v, s=s, g=g, w=w, pre=pre: ffn_from_twell(s.x, g, w.down_t, w_up=w.up, pre=pre, counters=c, **v), rep=40))
            ms = {n: sorted(t)[1] for n, t in times.items()}
            best = min(ms, key=ms.get)
            rec = dict(M=M, k=k, dist=dist, heavy_sigma=sigma, k_mean=k_mean, k_rms=k_rms, spread=k_rms / k_mean,
                       max_row=int(nnz.max()), ms=ms, rounds=times, best=best,
                       shipped=updown.default_config(D, k_mean, split=True, rms_k=k_rms))
            recs.append(rec)
            print(f"k {k} {dist} sigma {sigma} (mean {k_mean:.1f}, spread {k_rms / k_mean:.2f}): "
                  + ", ".join(f"{n} {t:.3f}" for n, t in ms.items()) + f" | best {best}", flush=True)
            del s, w, pre, g
            torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "split_spread_probe.json"), "w") as fh:
        json.dump(dict(machine_info(), records=recs), fh, indent=1)
    names = list(recs[0]["ms"])[1:]
    print("\ncase                 spread  token   " + "  ".join(f"{n[6:]:>6s}" for n in names) + "   best     rule")
    for r in recs:
        tn = next(n for n in r["ms"] if n.startswith("token"))
        case = f"k {r['k']} {r['dist']}" + (f" s{r['heavy_sigma']}" if r["heavy_sigma"] is not None else "")
        print(f"{case:20s} {r['spread']:6.2f}  {r['ms'][tn]:6.3f}  " + "  ".join(f"{r['ms'][n]:6.3f}" for n in names)
              + f"   {r['best']:10s} {r['shipped'][0]}x{r['shipped'][1]}")


if __name__ == "__main__":
    main()
