"""Where the FP8 decode kernel quantises x: in every program, in registers, or once by a kernel of
its own ahead of the weight kernel (:mod:`twell.kernels.decode_fp8`), at 1 to 8 tokens.

    python benchmarks/fp8_decode_quantise.py OUTDIR

d 2048, f 5632, k 29 with units even, bf16 x, FP8 weights of :func:`twell.fp8.fp8_gated_weights`.
Every variant is timed in a CUDA graph: one layer with L2 flushed before each replay
(``graph_ms``), and eight layers with their own weights chained in one graph without a flush
(``chain_graph_ms``, per layer). Variants: ``dense_bf16`` (the three products in PyTorch),
``inreg_4_4`` (x quantised in every program, 4 units and 4 warps per program), ``preq_BU_W`` (x
quantised first, BU units and W warps per program), ``chain_*`` the chained timings of
``dense_bf16``, ``inreg_4_4`` and ``preq_4_2``. ``err_vs_inreg``: the largest difference of each
variant's y from ``inreg_4_4``'s.

Writes OUTDIR/fp8_decode_<gpu>.json; prints one line per timing.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from twell.bench.cli import _gpu_tag
from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.timing import chain_graph_ms, graph_ms
from twell.fp8 import fp8_gated_weights
from twell.kernels.decode_fp8 import ffn_decode_fp8
from twell.kernels.decode_fused import DecodeScratch

D, F, K = 2048, 5632, 29


def main(out_dir: str) -> None:
    layers = []
    for i in range(8):
        s = make_ffn(16, D, F, K, "even", dtype=torch.bfloat16, device="cuda", seed=40 + i)
        layers.append((s, fp8_gated_weights(s.w_gate, s.w_up, s.w_down)))
    scratch = DecodeScratch(D, "cuda")
    records = []
    for M in (1, 2, 4, 8):
        s, w = layers[0]
        x = s.x[:M].contiguous()

        def decode(w=w, cfg=(4, 4), pre=False):
            return ffn_decode_fp8(x, w, scratch, config=cfg, prequant=pre)[0]

        y0 = decode().float()
        variants = {"dense_bf16": lambda: (torch.relu(x @ s.w_gate.T) * (x @ s.w_up.T)) @ s.w_down.T,
                    "inreg_4_4": decode}
        for cfg in [(4, 2), (2, 1), (4, 4)]:
            variants[f"preq_{cfg[0]}_{cfg[1]}"] = lambda cfg=cfg: decode(cfg=cfg, pre=True)
        for name, fn in variants.items():
            err = None if name == "dense_bf16" else float((fn().float() - y0).abs().max())
            ms = statistics.median(graph_ms(fn) for _ in range(3))
            records.append(dict(M=M, name=name, graph_ms=ms, err_vs_inreg=err))
            print(f"M={M} {name:12s} {ms * 1000:7.2f} us  err {err}", flush=True)
        chains = {"chain_dense": lambda s_, w_: (lambda: (torch.relu(x @ s_.w_gate.T) * (x @ s_.w_up.T)) @ s_.w_down.T),
                  "chain_inreg_4_4": lambda s_, w_: (lambda: decode(w=w_)),
                  "chain_preq_4_2": lambda s_, w_: (lambda: decode(w=w_, cfg=(4, 2), pre=True))}
        for name, make in chains.items():
            ms = chain_graph_ms([make(s_, w_) for s_, w_ in layers])
            records.append(dict(M=M, name=name, graph_ms=ms))
            print(f"M={M} {name:16s} {ms * 1000:7.2f} us/layer", flush=True)
    os.makedirs(out_dir, exist_ok=True)
    path = os.path.join(out_dir, f"fp8_decode_{_gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump(dict(d=D, f=F, k=K, distribution="even", records=records, **machine_info()), fh, indent=1)
    print("wrote", path)


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
