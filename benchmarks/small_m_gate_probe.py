"""How fast can a Triton gate product be at 16 to 64 tokens, against cuBLAS's (issue 9)?

    OUT=DIR python benchmarks/small_m_gate_probe.py

The split decode kernels' gate (pointer loads, one program per 64 units over all of d) takes
12.6 us per layer at 64 tokens where cuBLAS takes 9.2 (benchmarks/split_stage_probe.py). Here
the persistent tensor-descriptor matmul of ``twell.kernels.gate_pack_persistent`` (``pack=False``:
the product alone, written to ``[M, f]``) over a sweep of shapes, timed like the decode grid:
LAYERS products with their own weights back to back in one CUDA graph, us per product; cuBLAS
(``torch.mm``) beside it. M in {16, 64}. Writes OUT/small_m_gate_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os

import torch

from twell.bench.inference import machine_info
from twell.bench.timing import chain_graph_ms
from twell.kernels import gate_pack_persistent

LAYERS = 8
OUT = os.environ.get("OUT", "/tmp")
d, f = 2048, 5632
# (tile = units per block, block_k, warps, stages, programs)
SHAPES = [(64, 128, 4, 4, None), (64, 128, 4, 6, None), (64, 64, 4, 8, None), (128, 128, 4, 4, None),
          (128, 64, 8, 6, None), (32, 128, 4, 6, None), (64, 256, 4, 3, None), (64, 128, 4, 4, 88), (32, 256, 4, 3, None)]


def main() -> None:
    torch.manual_seed(0)
    ws = [torch.randn(f, d, device="cuda", dtype=torch.bfloat16) / d**0.5 for _ in range(LAYERS)]
    records = []
    for M in (16, 64):
        x = torch.randn(M, d, device="cuda", dtype=torch.bfloat16)
        ref = x.float() @ ws[0].float().T
        rec = dict(M=M, cublas_us=1e3 * chain_graph_ms([lambda w=w: torch.mm(x, w.t()) for w in ws]))
        for tile, bk, nw, ns, progs in SHAPES:
            name = f"{tile}x{bk} w{nw} s{ns}" + (f" P{progs}" if progs else "")
            kw = dict(tile=tile, block_m=max(16, M), block_k=bk, num_warps=nw, num_stages=ns, num_programs=progs, pack=False)
            try:
                out = gate_pack_persistent(x, ws[0], **kw)
                rec[name + " err"] = float((out.float() - ref).norm() / ref.norm())
                rec[name] = 1e3 * chain_graph_ms([lambda w=w: gate_pack_persistent(x, w, **kw) for w in ws])
            except Exception as e:  # noqa: BLE001 - a shape that does not fit: keep going
                rec[name] = None
                rec[name + " error"] = repr(e)[:160]
        records.append(rec)
        print(f"M {M}: cuBLAS {rec['cublas_us']:.1f} | " + " | ".join(
            f"{n} {rec[n]:.1f}" if rec[n] is not None else f"{n} -" for n in rec if n not in ("M", "cublas_us") and not n.endswith(("err", "error"))), flush=True)
    with open(os.path.join(OUT, "small_m_gate_probe.json"), "w") as fh:
        json.dump(dict(**machine_info(), layers=LAYERS, records=records), fh, indent=1)


if __name__ == "__main__":
    main()
