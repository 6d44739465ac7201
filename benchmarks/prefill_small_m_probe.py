"""Where the prefill kernels pay at a few thousand tokens per call, eager and in CUDA graphs
(issue 10: at M = 4096 the grid's k = 29 skewed record read 0.91x with the kernels chosen).

    python benchmarks/prefill_small_m_probe.py OUTDIR

For M in (4096, 8192) and k in (8, 16, 22, 29, 40) x (even, skewed): the dense module, twell's
dense path and the prefill kernels forced, each eager (interleaved calls, L2 flushed) and
captured in a CUDA graph; the layer's prefill cost estimate (LayerState.cost) beside them.
Writes OUTDIR/prefill_small_m_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os
import sys

import torch

from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import graph_ms, interleaved_ms


def main() -> None:
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
    out = []
    print(f"{'M':>6s} {'k':>3s} {'dist':6s} {'cost':>6s} | eager x: twell-dense prefill | graph x: twell-dense prefill")
    for M in (4096, 8192):
        for dist in ("even", "skewed"):
            for k in (8, 16, 22, 29, 40):
                s = make_ffn(M, 2048, 5632, k, dist, dtype=torch.bfloat16, device="cuda", seed=k + M)
                dense, twell = _pair(s)
                x = s.x
                with torch.no_grad():
                    _warm(twell, x)
                    cost = twell._twell_layer.cost(M)

                    def mode(name):
                        def call():
                            twell.kernel_mode = name
                            return twell(x)
                        return call

                    eager = interleaved_ms([lambda: dense(x), mode("dense"), mode("prefill")], calls=60)
                    graphs = []
                    for fn in (lambda: dense(x), mode("dense"), mode("prefill")):
                        graphs.append(graph_ms(fn))
                    twell.kernel_mode = "auto"
                rec = dict(M=M, k=k, distribution=dist, cost=cost, dense_eager_ms=eager[0], twell_dense_eager_ms=eager[1],
                           prefill_eager_ms=eager[2], dense_graph_ms=graphs[0], twell_dense_graph_ms=graphs[1],
                           prefill_graph_ms=graphs[2])
                out.append(rec)
                print(f"{M:6d} {k:3d} {dist:6s} {cost or float('nan'):6.1f} | {eager[0] / eager[1]:5.2f} {eager[0] / eager[2]:5.2f} "
                      f"| {graphs[0] / graphs[1]:5.2f} {graphs[0] / graphs[2]:5.2f}", flush=True)
                del s, dense, twell, x
                torch.cuda.empty_cache()
    with open(os.path.join(outdir, "prefill_small_m_probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
