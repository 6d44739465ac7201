"""Device experiment: from how many active units a row should be computed whole on tensor cores
(``twell.kernels.updown.DENSE_ROW_MIN``) instead of in the first up/down launch. The forced op
(``twell_gated_mlp``: cuBLAS gate, pack, up/down with the dense-rows path) at several limits,
and with heavy rows at the split path's narrow shape, against dense PyTorch; bf16, d 2048,
f 5632, three interleaved rounds, medians.

    python benchmarks/dense_rows_probe.py [OUTDIR]

Writes OUTDIR/dense_rows_probe.json; prints the table last.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from twell.bench.inference import bench_ms, dense_gated, errors, machine_info, reference_fp32
from twell.bench.synthetic import make_ffn
from twell.kernels import updown
from twell.ops import prepare_gated_weights, twell_gated_mlp

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
D, F = 2048, 5632
CASES = [(M, k, "heavy") for M in (16384, 131072) for k in (8, 29, 56, 128)] + [(16384, 56, "even"), (131072, 29, "even")]
LIMITS = (128, 256, 512, 1 << 20)


def main() -> None:
    recs = []
    shipped, split_cfg = updown.DENSE_ROW_MIN, dict(updown.SPLIT_CONFIG)
    with torch.no_grad():
        for M, k, dist in CASES:
            s = make_ffn(M, D, F, k, dist, torch.bfloat16, "cuda", seed=M + k + D)
            w = prepare_gated_weights(s.w_up, s.w_down)
            nnz = (s.x @ s.w_gate.T > 0).sum(1)
            ref = reference_fp32(s.x, s.w_gate, s.w_up, s.w_down)
            variants = {f"limit {lim}": (lim, False) for lim in LIMITS}
            if M >= updown.SPLIT_MIN_M:
                variants[f"limit {shipped}, split 1x2"] = (shipped, True)
            times = {n: [] for n in variants}
            times["dense"] = []
            err = {}
            for rnd in range(3):
                for n, (lim, narrow) in variants.items():
                    updown.DENSE_ROW_MIN = lim
                    if narrow:
                        updown.SPLIT_CONFIG[2048] = updown.SPLIT_NARROW[2048]
                    try:
                        fn = lambda s=s, w=w: twell_gated_mlp(s.x, s.w_gate, s.w_up, s.w_down, weights=w)  # noqa: E731
                        if rnd == 0:
                            err[n] = errors(fn(), ref)
                        times[n].append(bench_ms(fn, rep=40))
                    finally:
                        updown.DENSE_ROW_MIN = shipped
                        updown.SPLIT_CONFIG.clear()
                        updown.SPLIT_CONFIG.update(split_cfg)
                times["dense"].append(bench_ms(lambda s=s: dense_gated(s.x, s.w_gate, s.w_up, s.w_down), rep=40))
            ms = {n: sorted(t)[1] for n, t in times.items()}
            rec = dict(M=M, k=k, dist=dist, k_mean=float(nnz.float().mean()),
                       rows_above={lim: int((nnz > lim).sum()) for lim in LIMITS[:-1]}, ms=ms, rounds=times,
                       speedup={n: ms["dense"] / t for n, t in ms.items() if n != "dense"}, errors=err)
            recs.append(rec)
            print(f"M {M} k {k} {dist}: " + ", ".join(f"{n} {t:.3f}" for n, t in ms.items())
                  + f" | rows above {rec['rows_above']}", flush=True)
            del s, w, ref
            torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "dense_rows_probe.json"), "w") as fh:
        json.dump(dict(machine_info(), records=recs), fh, indent=1)
    print("\ncase                  " + "  ".join(f"{n:>18s}" for n in recs[-1]["speedup"]))
    for r in recs:
        print(f"M {r['M']:6d} k {r['k']:3d} {r['dist']:6s} " + "  ".join(f"{r['speedup'].get(n, float('nan')):18.3f}" for n in recs[-1]["speedup"]))


if __name__ == "__main__":
    main()
