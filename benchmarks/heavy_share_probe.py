"""Where a layer with many heavy rows should stop taking the sparse op (ELL rows + rows held
dense) and train on the dense op (``twell.train_path.HEAVY_SHARE_MAX``): forward + backward of
the gated FFN at M 16384, d 2048, f 5632, k 29 for the light rows, with a share p of the rows
made heavy (about 600 active units), timed call by call in turn three ways: dense PyTorch
(no L1 term), the sparse op, the all-rows-dense op (both with the L1 term).

    python benchmarks/heavy_share_probe.py [OUTDIR]

Writes OUTDIR/heavy_share_probe.json; prints a table.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from twell.bench.timing import interleaved_ms
from twell.bench.training import LAM, _dense_fn, _sparse_fn
from twell.train_ops import choose_width, dense_gated_ffn

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")


def tensors(p: float, M=16384, d=2048, f=5632, k=29, heavy_k=600):
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(M, d, generator=g, device="cuda")
    wg = torch.randn(f, d, generator=g, device="cuda") / math.sqrt(d - 1)
    thr = float(torch.special.ndtri(torch.tensor(1.0 - k / f, dtype=torch.float64)))
    thr_heavy = float(torch.special.ndtri(torch.tensor(1.0 - heavy_k / f, dtype=torch.float64)))
    x[:, 0] = 1.0
    wg[:, 0] = -thr
    n = int(round(p * M))
    x[torch.randperm(M, generator=g, device="cuda")[:n], 0] = thr_heavy / thr  # about heavy_k active
    wu = torch.randn(f, d, generator=g, device="cuda") / math.sqrt(d)
    wd = torch.randn(d, f, generator=g, device="cuda") / math.sqrt(f)
    return [t.to(torch.bfloat16).requires_grad_(True) for t in (x, wg, wu, wd)]


def main() -> None:
    rows = []
    for p in (0.0, 0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 1.0):
        x, wg, wu, wd = tensors(p)
        dy = torch.randn_like(x) / math.sqrt(x.shape[1])
        with torch.no_grad():
            counts = (torch.mm(x, wg.t()) > 0).sum(1)
        width = choose_width(29.0)
        rec = dict(p=p, width=width, heavy=int((counts > width).sum()), k_mean=float(counts.float().mean()))
        lam = torch.full((), LAM, device="cuda")

        def dense_op(x=x, wg=wg, wu=wu, wd=wd, dy=dy):
            out = dense_gated_ffn(x, wg, wu, wd)
            return torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam))

        fns = [_dense_fn(x, wg, wu, wd, dy), _sparse_fn(x, wg, wu, wd, dy, width), dense_op]
        rec["dense_ms"], rec["sparse_ms"], rec["dense_op_ms"] = interleaved_ms(fns, calls=30, warmup=2)
        rows.append(rec)
        print(f"p {p:5.2f} heavy {rec['heavy']:6d} k {rec['k_mean']:7.1f} dense {rec['dense_ms']:.3f} "
              f"sparse op {rec['sparse_ms']:.3f} dense op {rec['dense_op_ms']:.3f} ms", flush=True)
        del x, wg, wu, wd, dy
    with open(os.path.join(OUT, "heavy_share_probe.json"), "w") as fh:
        json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
