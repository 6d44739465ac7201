"""The weight-gradient kernel in one launch (gathers x and dy rows) against two (one gathering
x rows for dw_up and dw_gate, one gathering dy rows for dw_down^T): kernel times over a few
launch configurations, the outputs compared bit for bit, then one layer's training call (module
with default settings, sparse op forced) with ``GRADS_CONFIG`` one way and the other.

Why: at M 16384 the kernel gathers from x and dy, 128 MB together, more than the 50 MB L2; the
twenty-sixth session's probe read 0.88 ms as shipped and 0.68 ms with dy := x (a 64 MB working
set, the same work). Two launches each gather from one 64 MB matrix.

    python benchmarks/train_wgrad_split_probe.py [OUTDIR]

Writes OUTDIR/train_wgrad_split_probe.json; prints one line per case.
"""

from __future__ import annotations

import itertools
import json
import os
import sys

import torch

from train_auto_rule_probe import case, synthetic  # (benchmarks/ is on the path)
from twell import train_ops
from twell.bench.inference import bench_ms, machine_info
from twell.bench.training import stage_tensors
from twell.kernels import train_ffn as K
from twell.kernels.train_index import unit_index

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
D, F = 2048, 5632
KERNEL_CASES = [(16384, 29, "even"), (16384, 56, "even"), (16384, 29, "skewed"), (16384, 8, "even"), (65536, 29, "even")]
MODULE_CASES = [(16384, 29, "even"), (16384, 56, "even"), (16384, 29, "skewed"), (65536, 29, "even")]


def kernel_case(M: int, k: float, dist: str) -> dict:
    t = stage_tensors(M, k, dist, D, F)
    x, wu, dy, W, cols, g, cnt, u, du, da = t.x, t.wu, t.dy, t.W, t.cols, t.g, t.cnt, t.u, t.du, t.da
    order, offsets = unit_index(cols, cnt, F)
    rec = dict(M=M, k=k, dist=dist, width=W, unit_index_ms=bench_ms(lambda: unit_index(cols, cnt, F)), configs=[])
    ref = K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, **train_ops.GRADS_CONFIG)
    for split, bt, nw in itertools.product((False, True), (2, 4, 8), (4, 8)):
        cfg = dict(block_t=bt, num_warps=nw, split=split)
        fn = lambda cfg=cfg: K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, **cfg)
        out = fn()
        same = all(torch.equal(o, r) for o, r in zip(out, ref)) if bt == train_ops.GRADS_CONFIG["block_t"] else None
        rec["configs"].append(dict(cfg, ms=bench_ms(fn), same_bits=same))
    best = {s: min((r for r in rec["configs"] if r["split"] == s), key=lambda r: r["ms"]) for s in (False, True)}
    cfg = train_ops.GRADS_CONFIG
    shipped = next(r for r in rec["configs"] if r["split"] == cfg.get("split", False) and r["block_t"] == cfg["block_t"]
                   and r["num_warps"] == cfg["num_warps"])
    print(f"M {M} k {k} {dist} W {W}: unit index {rec['unit_index_ms']:.3f} ms; weight grads shipped {shipped['ms']:.3f}, "
          f"best one launch {best[False]['ms']:.3f} (bt {best[False]['block_t']} w {best[False]['num_warps']}), "
          f"best split {best[True]['ms']:.3f} (bt {best[True]['block_t']} w {best[True]['num_warps']}); same bits "
          f"{[r['same_bits'] for r in rec['configs'] if r['same_bits'] is not None]}", flush=True)
    return rec


def main() -> None:
    kernels = [kernel_case(*c) for c in KERNEL_CASES]
    torch.cuda.empty_cache()
    shipped = dict(train_ops.GRADS_CONFIG)
    modules = []
    for split in (False, True, False, True):
        train_ops.GRADS_CONFIG = dict(shipped, split=split)
        for M, k, dist in MODULE_CASES:
            rec = case(f"{dist} k{k} split {split}", M, synthetic(M, k, dist), calls=30)
            modules.append(dict(rec, split=split))
            torch.cuda.empty_cache()
    train_ops.GRADS_CONFIG = shipped
    with open(os.path.join(OUT, "train_wgrad_split_probe.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), kernels=kernels, modules=modules), fh, indent=1)


if __name__ == "__main__":
    main()
