"""Is one Triton kernel for ``relu(x w_gate^T) * (x w_up^T)`` faster than the dense branch's two
cuBLAS products and its ``relu_mul_`` pass, between 65 and 1024 tokens? (issue 9: 256 tokens
at 1.2x dense; the module's dense branch reads 1.07x there.)

    OUT=DIR python benchmarks/gate_up_probe.py

Eight layers with their own weights back to back in one CUDA graph, microseconds per layer
(``twell.bench.timing.chain_graph_ms``), k 29 even: dense (three nn.Linear), the twell module
(default settings, its dense branch above 64 tokens), and ``gate_up`` + the down product
(``F.linear``) at several tile shapes, with relative errors against fp32. Writes
OUT/gate_up_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os

import torch
import torch.nn.functional as F

from twell.bench.inference import errors, reference_fp32
from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import chain_graph_ms
from twell.kernels.gate_up import GateUpConfig, gate_up

OUT = os.environ.get("OUT", "/tmp")
LAYERS = 8
C = GateUpConfig
SHAPES = [C(64, 128, 64, 4, 4), C(128, 64, 64, 4, 4), C(128, 128, 64, 8, 3), C(64, 64, 64, 4, 4), C(64, 128, 64, 8, 4),
          C(128, 128, 64, 8, 4), C(64, 256, 64, 8, 3), C(32, 128, 64, 4, 4), C(64, 128, 128, 8, 3), C(128, 256, 64, 8, 3)]


def main() -> None:
    s = make_ffn(4096, 2048, 5632, 29, "even", dtype=torch.bfloat16, device="cuda", seed=52)
    pairs = [_pair(s) for _ in range(LAYERS)]
    dense = [p[0] for p in pairs]
    twell = [p[1] for p in pairs]
    records = []
    for M in (64, 96, 128, 192, 256, 384, 512, 1024):
        x = s.x[:M].contiguous()
        rec = dict(M=M, k=29, distribution="even", layers=LAYERS)
        with torch.no_grad():
            for t in twell:
                _warm(t, x)
            ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
            rec["dense_us"] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in dense])
            rec["twell_us"] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in twell])
            rec["twell_path"] = twell[0].last_path
            rec["dense_err"] = errors(dense[0](x), ref)
            for cfg in SHAPES:
                name = "x".join(map(str, cfg))

                def layer(m, cfg=cfg):
                    return F.linear(gate_up(x, m.gate_proj.weight, m.up_proj.weight, cfg), m.down_proj.weight)
                try:
                    rec[name] = 1e3 * chain_graph_ms([lambda m=m: layer(m) for m in dense])
                    rec[name + " err"] = errors(layer(dense[0]), ref)
                except Exception as e:  # noqa: BLE001 - a shape that does not compile: keep going
                    rec[name] = None
                    rec[name + " error"] = repr(e)[:200]
        records.append(rec)
        names = ["x".join(map(str, c)) for c in SHAPES]
        best = min((n for n in names if rec[n] is not None), key=lambda n: rec[n])
        print(f"M {M:4d} dense {rec['dense_us']:6.1f} twell {rec['twell_us']:6.1f} ({rec['twell_path']}) x{rec['dense_us'] / rec['twell_us']:.2f} | "
              + " ".join(f"{rec[n]:6.1f}" if rec[n] is not None else "   -  " for n in names)
              + f" | best {best} {rec[best]:.1f} x{rec['dense_us'] / rec[best]:.2f} err {rec[best + ' err'][0]:.1e}/{rec['dense_err'][0]:.1e}"
              f" row {rec[best + ' err'][1]:.1e}/{rec['dense_err'][1]:.1e}", flush=True)
    print("columns: BMxBNxBKxwarpsxstages:", " | ".join("x".join(map(str, c)) for c in SHAPES))
    with open(os.path.join(OUT, "gate_up_probe.json"), "w") as fh:
        json.dump({"meta": dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__), "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
