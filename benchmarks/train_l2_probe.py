"""Device experiment: how much of the sparse training kernels' time is L2 capacity, and what the
unit index's sort costs by key width. M 16384, k 29 even, bf16, d 2048, f 5632, W from "auto".

Each kernel is timed as shipped, then on inputs that shrink its working set without changing the
work (same launch, same number of gathers and products; the results are not used):

- rows kernels with the weights aliased (w_gate := w_up, w_down^T := w_up: 69 -> 46 -> 23 MB);
- rows kernels with every column folded into the first quarter of the units (cols % (f / 4));
- weight gradients with dy := x (x and dy 128 -> 64 MB) and with every token folded into the
  first 4096 rows (32 MB, L2-resident);
- the unit index's torch.sort on int32 keys (shipped) against int16 keys.

    python benchmarks/train_l2_probe.py [OUTDIR]

Writes OUTDIR/train_l2_probe.json; prints a table last.
"""

from __future__ import annotations

import json
import math
import os
import sys
from types import SimpleNamespace

import torch

from twell.bench.inference import bench_ms, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import train_ffn as K
from twell.kernels.train_index import slot_keys, unit_index
from twell.train_ops import GRADS_CONFIG, PACK_CONFIG, ROWS_CONFIG, choose_width

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
M, D, F, KACT = 16384, 2048, 5632, 29


def training_case(M: int = M, k: float = KACT) -> SimpleNamespace:
    """One training layer's inputs at bf16, d D, f F, units even: the weights (w_down also as
    w_down^T rows, ``wdt``), x, a gradient dy, the ELL rows at the width "auto" gives, l1 scale 0."""
    s = make_ffn(M, D, F, k, "even", torch.bfloat16, "cuda", seed=1)
    dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16) / math.sqrt(D)
    with torch.no_grad():
        a = torch.mm(s.x, s.w_gate.t())
    W = choose_width(float((a > 0).sum(1).float().mean()), None, F)
    cols, g, cnt = K.pack_rows(a, W, **PACK_CONFIG)
    return SimpleNamespace(x=s.x, wg=s.w_gate, wu=s.w_up, wd=s.w_down, wdt=s.w_down.t().contiguous(), dy=dy, a=a,
                           W=W, cols=cols, g=g, cnt=cnt, c=torch.zeros(1, device="cuda"))


def main() -> None:
    t = training_case()
    x, wg, wu, dy, a, W, wdt, cols, g, cnt = t.x, t.wg, t.wu, t.dy, t.a, t.W, t.wdt, t.cols, t.g, t.cnt
    cols_q = (cols.to(torch.int32) % (F // 4)).to(cols.dtype)
    c = t.c
    y, u, _ = K.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **ROWS_CONFIG)
    dx, du, da = K.ffn_rows_backward(dy, cols, g, u, cnt, wdt, wu, wg, c, **ROWS_CONFIG)
    order, offsets = unit_index(cols, cnt, F)
    # every pair's token folded into the first 4096 rows: same gathers, a 32 MB working set
    order_fold = (order // W % 4096) * W + order % W
    keys = slot_keys(cols, cnt, F)
    keys16 = keys.to(torch.int16)
    ar32 = torch.arange(F + 1, dtype=torch.int32, device="cuda")
    ar16 = ar32.to(torch.int16)

    def index16():
        sk, o = torch.sort(slot_keys(cols, cnt, F).to(torch.int16), stable=True)
        return o, torch.searchsorted(sk, ar16)

    same16 = bool(torch.equal(index16()[0], order))
    cases = {
        "gate_mm": lambda: torch.mm(x, wg.t()),
        "pack": lambda: K.pack_rows(a, W, **PACK_CONFIG),
        "fwd_rows": lambda: K.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **ROWS_CONFIG),
        "fwd_rows_wdt=wu": lambda: K.ffn_rows_forward(x, cols, g, cnt, wu, wu, **ROWS_CONFIG),
        "fwd_rows_quarter_units": lambda: K.ffn_rows_forward(x, cols_q, g, cnt, wdt, wu, **ROWS_CONFIG),
        "bwd_rows": lambda: K.ffn_rows_backward(dy, cols, g, u, cnt, wdt, wu, wg, c, **ROWS_CONFIG),
        "bwd_rows_wg=wu": lambda: K.ffn_rows_backward(dy, cols, g, u, cnt, wdt, wu, wu, c, **ROWS_CONFIG),
        "bwd_rows_all=wu": lambda: K.ffn_rows_backward(dy, cols, g, u, cnt, wu, wu, wu, c, **ROWS_CONFIG),
        "bwd_rows_quarter_units": lambda: K.ffn_rows_backward(dy, cols_q, g, u, cnt, wdt, wu, wg, c, **ROWS_CONFIG),
        "wgrads": lambda: K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, **GRADS_CONFIG),
        "wgrads_dy=x": lambda: K.ffn_weight_grads(order, offsets, x, x, g, u, du, da, dtype=wu.dtype, **GRADS_CONFIG),
        "wgrads_fold_4096": lambda: K.ffn_weight_grads(order_fold, offsets, x, dy, g, u, du, da, dtype=wu.dtype, **GRADS_CONFIG),
        "unit_index": lambda: unit_index(cols, cnt, F),
        "slot_keys": lambda: slot_keys(cols, cnt, F),
        "sort_int32": lambda: torch.sort(keys, stable=True),
        "sort_int16": lambda: torch.sort(keys16, stable=True),
        "searchsorted_int32": lambda: torch.searchsorted(keys, ar32),
        "unit_index_int16": index16,
    }
    res = {name: [] for name in cases}
    for _ in range(3):  # rounds, interleaved
        for name, fn in cases.items():
            res[name].append(bench_ms(fn, rep=50))
    rec = dict(machine_info(), M=M, d=D, f=F, k=KACT, W=W, same_order_int16=same16,
               ms={n: sorted(v)[1] for n, v in res.items()}, rounds=res)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "train_l2_probe.json"), "w") as fh:
        json.dump(rec, fh, indent=1)
    print(f"M {M} k {KACT} W {W}; int16 sort gives the same order: {same16}")
    for n, v in rec["ms"].items():
        print(f"{n:28s} {v:.4f} ms   rounds {' '.join(f'{t:.4f}' for t in res[n])}")


if __name__ == "__main__":
    main()
