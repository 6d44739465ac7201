"""Device experiment: the training ELL pack (`twell.kernels.train_ffn.pack_rows`) at a few launch
shapes, and the inference TwELL pack at its default, on synthetic pre-activations (bf16, d 2048,
f 5632, the width "auto" gives). For an A/B of two trees run it with each tree's ``src`` first
on PYTHONPATH and compare; every shape's output is checked against the first shape's.

    python benchmarks/train_pack_probe.py [OUTDIR] [LABEL]

Writes OUTDIR/train_pack_probe_LABEL.json; prints the best shape per case last.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from twell.bench.inference import bench_ms, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import pack_relu
from twell.kernels.train_ffn import pack_rows
from twell.ops import DEFAULT_COMPRESSION, default_tile
from twell.train_ops import PACK_CONFIG, choose_width

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
LABEL = sys.argv[2] if len(sys.argv) > 2 else "run"
D, F = 2048, 5632
CASES = [(16384, 29, "even"), (16384, 8, "even"), (16384, 56, "even"), (16384, 29, "heavy"), (65536, 29, "even")]
SHAPES = [(PACK_CONFIG["block_m"], PACK_CONFIG["block_f"], PACK_CONFIG["num_warps"]),
          (1, 256, 1), (2, 256, 1), (4, 256, 1), (2, 256, 2), (4, 256, 2), (2, 512, 1)]


def main() -> None:
    records, best = [], []
    with torch.no_grad():
        for M, k, dist in CASES:
            s = make_ffn(M, D, F, k, dist, device="cuda", seed=3)
            a = torch.mm(s.x, s.w_gate.t())
            mean = float((a > 0).sum(1).float().mean())
            W = choose_width(mean, None, F)
            ref = pack_rows(a, W, block_m=SHAPES[0][0], block_f=SHAPES[0][1], num_warps=SHAPES[0][2])
            row = dict(M=M, k=k, dist=dist, k_mean=mean, W=W, shapes={})
            for rnd in range(2):
                for bm, bf, nw in SHAPES:
                    fn = lambda: pack_rows(a, W, block_m=bm, block_f=bf, num_warps=nw)  # noqa: E731
                    ms = bench_ms(fn)
                    out = fn()
                    light = ref[2] <= W
                    same = bool(torch.equal(out[2], ref[2])) and bool(torch.equal(out[0][light], ref[0][light])) \
                        and bool(torch.equal(out[1][light], ref[1][light]))
                    row["shapes"].setdefault(f"{bm}x{bf}x{nw}", []).append(ms)
                    records.append(dict(M=M, k=k, dist=dist, shape=[bm, bf, nw], round=rnd, ms=ms, same=same))
                    print(f"M {M} k {k} {dist} W {W} shape {bm}x{bf}x{nw}: {ms:.4f} ms same {same}", flush=True)
            row["twell_pack_ms"] = bench_ms(lambda: pack_relu(a, default_tile(F), DEFAULT_COMPRESSION))
            row["read_ms"] = bench_ms(lambda: a.sum(dtype=torch.float32))
            b = min(row["shapes"].items(), key=lambda kv: min(kv[1]))
            best.append((M, k, dist, W, b[0], min(b[1]), min(row["shapes"][f"{SHAPES[0][0]}x{SHAPES[0][1]}x{SHAPES[0][2]}"]),
                         row["twell_pack_ms"], row["read_ms"]))
            records.append(row)
            del s, a, ref
            torch.cuda.empty_cache()
    import twell

    with open(os.path.join(OUT, f"train_pack_probe_{LABEL}.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), label=LABEL, twell=os.path.dirname(twell.__file__), records=records), fh, indent=1)
    print(f"\n[{LABEL}] M k dist W | best shape ms | shipped shape ms | inference pack ms | read ms")
    for r in best:
        print(f"[{LABEL}] {r[0]} {r[1]} {r[2]} W {r[3]} | {r[4]} {r[5]:.4f} | {r[6]:.4f} | {r[7]:.4f} | {r[8]:.4f}")


if __name__ == "__main__":
    main()
