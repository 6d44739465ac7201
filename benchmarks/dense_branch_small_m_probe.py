"""Issue 8/9 at d 4096 on the H200: why does the module's dense branch read 0.94x to 0.99x dense
PyTorch at 256 tokens in the decode grid (`twell bench decode --shape 4096x11008`, fifty-second
session; 1.07x to 1.10x on the H100, 1.06x at d 2048 on the H200)?

The grid timed dense first and the module second, once per record (eight layers chained in one
CUDA graph, per layer). This times, in alternating rounds, eight chained layers of:

- ``dense``: the three-``nn.Linear`` MLP (``DenseMLP``) the grids compare against;
- ``auto``: the module, default settings (after warm-up calls), in the graph;
- ``branch``: the module forced to its dense branch (``kernel_mode = "dense"``): cuBLAS gate and
  up, ``relu_mul_`` (one Triton pass) above ``LayerState.GRAPH_SMALL_M`` tokens, cuBLAS down
  through the transposed view of the kernels' ``[f, d]`` down weight;
- ``branch_torch``: the same with ``GRAPH_SMALL_M`` raised past M (two in-place PyTorch ops
  instead of ``relu_mul_``);
- ``down_view`` / ``down_contig``: the down product alone, through the view and through a
  contiguous ``[d, f]`` copy (the layout's share of any gap).

    OUT=dir python benchmarks/dense_branch_small_m_probe.py   # writes OUT/dense_branch_small_m.json
"""

import json
import os
import statistics

import torch
import torch.nn.functional as F

from twell.bench.inference import machine_info
from twell.bench.runtime import CHAIN_LAYERS, _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import chain_graph_ms
from twell.dispatch import LayerState

SHAPES = [(4096, 11008), (2048, 5632)]
MS = (128, 256, 512)
K = 29
ROUNDS = 3
OUT = os.environ.get("OUT", "/tmp")


def time_shape(d: int, f: int, records: list) -> None:
    """Appends one record per M for a layer of width d and f units (and rewrites the file)."""
    s = make_ffn(4096, d, f, K, "even", dtype=torch.bfloat16, device="cuda", seed=K + 23)
    pairs = [_pair(s) for _ in range(CHAIN_LAYERS)]
    denses, twells = [p[0] for p in pairs], [p[1] for p in pairs]
    views = [t.down_proj.weight for t in twells]  # what the dense branch passes to F.linear
    contig = [w.contiguous() for w in views]
    for M in MS:
        x = s.x[:M].contiguous()
        hs = [torch.randn(M, f, device="cuda", dtype=torch.bfloat16) for _ in range(CHAIN_LAYERS)]
        with torch.no_grad():
            for t in twells:
                _warm(t, x)

            def module_chain(mode, small_m=None):
                for t in twells:
                    t.kernel_mode = mode
                old = LayerState.GRAPH_SMALL_M
                if small_m is not None:
                    LayerState.GRAPH_SMALL_M = small_m
                try:
                    return 1e3 * chain_graph_ms([lambda m=m: m(x) for m in twells])
                finally:
                    LayerState.GRAPH_SMALL_M = old
                    for t in twells:
                        t.kernel_mode = "auto"

            variants = {
                "dense": lambda: 1e3 * chain_graph_ms([lambda m=m: m(x) for m in denses]),
                "auto": lambda: module_chain("auto"),
                "branch": lambda: module_chain("dense"),
                "branch_torch": lambda: module_chain("dense", small_m=1 << 20),
                "down_view": lambda: 1e3 * chain_graph_ms([lambda h=h, w=w: F.linear(h, w) for h, w in zip(hs, views)]),
                "down_contig": lambda: 1e3 * chain_graph_ms([lambda h=h, w=w: F.linear(h, w) for h, w in zip(hs, contig)]),
            }
            times = {name: [] for name in variants}
            for _ in range(ROUNDS):
                for name, fn in variants.items():
                    times[name].append(fn())
        rec = dict(d=d, f=f, M=M, k=K, rounds=ROUNDS, path=twells[0].last_path, **{f"{n}_us": v for n, v in times.items()})
        med = {n: statistics.median(v) for n, v in times.items()}
        rec.update({f"{n}_median_us": v for n, v in med.items()}, **machine_info())
        records.append(rec)
        print(f"d {d} M {M:4d} " + " ".join(f"{n} {v:6.1f}" for n, v in med.items())
              + f" | dense/auto x{med['dense'] / med['auto']:.3f} dense/branch x{med['dense'] / med['branch']:.3f}"
              + f" dense/branch_torch x{med['dense'] / med['branch_torch']:.3f}"
              + f" view/contig x{med['down_contig'] / med['down_view']:.3f}", flush=True)
        with open(os.path.join(OUT, "dense_branch_small_m.json"), "w") as fh:
            json.dump(records, fh, indent=1)


records = []
for d, f in SHAPES:
    time_shape(d, f, records)
    torch.cuda.empty_cache()
