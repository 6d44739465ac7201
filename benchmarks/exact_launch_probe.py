"""Device experiment: the up/down's exact path for overflowed tiles, as it was (one program per
token, each overflowed tile walked unit by unit: the per-row launch) against the rows with an
overflowed tile listed on the device and computed whole on tensor cores (``pre_writable``, the
dense-rows path), and against no exact launch at all (a wrapper drops the per-row launch: y is
then wrong where tiles overflowed, a floor). bf16, d 2048, f 5632, the module's TwELL (cuBLAS
gate, ``pack_relu``) and up/down shape for the case; also the whole forced op
(``twell_gated_mlp``) against dense. Three interleaved rounds, medians. The dense-rows calls
overwrite the listed rows of ``pre`` with h on every call (the same work each time); ``pre`` is
restored after them, so that the per-row launch reads the gate. (The committed
``results/runtime_probe/s27/exact_launch_probe.json`` came from the version before that
restore: its per-row heavy-row times in rounds 2 and 3 read h, fewer active units than the
gate has, so they understate that launch's cost.)

    python benchmarks/exact_launch_probe.py [OUTDIR]

Writes OUTDIR/exact_launch_probe.json; prints the table last.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from twell.bench.inference import bench_ms, dense_gated, machine_info
from twell.kernels import OverflowCounters, ffn_from_twell, updown
from twell.ops import twell_gated_mlp
from updown_split_probe import twell_case

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
D, F = 2048, 5632
CASES = ([(M, 29, "even") for M in (4096, 16384, 131072)]
         + [(M, k, "heavy") for M in (4096, 16384, 131072) for k in (8, 29, 56)])
REAL = updown._ffn_from_twell_kernel


class _NoExact:
    """Stands in for the fused kernel: launches it, except in ONLY_OVER mode."""

    def __getitem__(self, grid):
        def launch(*args, **kw):
            if not kw["ONLY_OVER"]:
                REAL[grid](*args, **kw)
        return launch


def main() -> None:
    recs = []
    shipped = dict(updown.DENSE_ROWS_CONFIG)
    with torch.no_grad():
        for M, k, dist in CASES:
            s, w, pre, g, nnz = twell_case(M, k, dist)
            k_mean, k_rms = float(nnz.mean()), float(nnz.pow(2).mean().sqrt())
            be, nw = updown.default_config(D, k_mean, split=updown.splits(M, True, d=D), rms_k=k_rms)
            c = OverflowCounters.zeros("cuda")
            pristine = pre.clone()

            def run(writable, s=s, g=g, w=w, pre=pre):
                return ffn_from_twell(s.x, g, w.down_t, w_up=w.up, pre=pre, counters=c, block_e=be, num_warps=nw,
                                      pre_writable=writable)

            variants = {"per-row launch": (False, REAL, shipped), "no exact launch": (False, _NoExact(), shipped),
                        "dense rows": (True, REAL, shipped), "dense rows bm32": (True, REAL, dict(shipped, block_m=32)),
                        "dense rows bm16": (True, REAL, dict(shipped, block_m=16, num_warps=2))}
            times = {n: [] for n in variants}
            times.update({"op dense": [], "op twell": []})
            for _ in range(3):
                for n, (writable, kern, cfg) in variants.items():
                    updown._ffn_from_twell_kernel, updown.DENSE_ROWS_CONFIG = kern, cfg
                    try:
                        times[n].append(bench_ms(lambda writable=writable, run=run: run(writable), rep=40))
                    finally:
                        updown._ffn_from_twell_kernel, updown.DENSE_ROWS_CONFIG = REAL, shipped
                        pre.copy_(pristine)
                times["op dense"].append(bench_ms(lambda s=s: dense_gated(s.x, s.w_gate, s.w_up, s.w_down), rep=40))
                times["op twell"].append(bench_ms(lambda s=s, w=w: twell_gated_mlp(s.x, s.w_gate, s.w_up, s.w_down, weights=w), rep=40))
            ms = {n: sorted(t)[1] for n, t in times.items()}
            rec = dict(M=M, k=k, dist=dist, k_mean=k_mean, shape=f"{be}x{nw}", overflow_rows=int((g.counts > g.slots).any(1).sum()),
                       ms=ms, rounds=times)
            recs.append(rec)
            print(f"M {M} k {k} {dist}: " + ", ".join(f"{n} {t:.4f}" for n, t in ms.items()), flush=True)
            del s, w, pre, g, run, pristine
            torch.cuda.empty_cache()
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "exact_launch_probe.json"), "w") as fh:
        json.dump(dict(machine_info(), records=recs), fh, indent=1)
    names = list(recs[0]["ms"])
    print("\ncase                ovf rows " + " ".join(f"{n:>15s}" for n in names))
    for r in recs:
        print(f"M {r['M']:6d} k {r['k']:2d} {r['dist']:6s} {r['overflow_rows']:5d} " + " ".join(f"{r['ms'][n]:15.4f}" for n in names))


if __name__ == "__main__":
    main()
