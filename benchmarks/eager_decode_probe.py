"""Would eager small batches gain from the decode kernels? (issue 8: eager records at M <= 256
read 0.89x to 1.04x dense from run to run, both sides on cuBLAS with the same host time.)

    OUT=DIR python benchmarks/eager_decode_probe.py

The decode kernels are two or three Triton launches against dense's five PyTorch ops, so they
may issue faster as well as run faster. For M in 1 to 64 and two sparsity patterns: eager
milliseconds per call of the dense MLP, the twell module as shipped ("auto": dense below a
capture) and the twell module with its decode kernels forced, timed call by call in turn
(``interleaved_ms``, as ``twell bench batch`` does), host time per call, and the forced path's
error against dense's. Writes OUT/eager_decode_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os

import torch

from twell.bench.runtime import _pair
from twell.bench.synthetic import make_ffn
from twell.bench.timing import host_us, interleaved_ms

OUT = os.environ.get("OUT", "/tmp")


def main() -> None:
    records = []
    for k, dist in ((29, "even"), (280, "heavy"), (8, "even")):
        s = make_ffn(64, 2048, 5632, k, dist, dtype=torch.bfloat16, device="cuda", seed=41)
        dense, auto = _pair(s)
        _, forced = _pair(s)
        forced.kernel_mode = "decode"
        for M in (1, 2, 4, 8, 16, 32, 64):
            x = s.x[:M].contiguous()
            with torch.no_grad():
                ref = dense(x).float()
                err = ((forced(x).float() - ref).norm() / ref.norm()).item()
                fns = [lambda: dense(x), lambda: auto(x), lambda: forced(x)]
                ms = [interleaved_ms(fns) for _ in range(2)]
                host = [host_us(fn) for fn in fns]
            rec = dict(M=M, k=k, distribution=dist, dense_ms=[r[0] for r in ms], auto_ms=[r[1] for r in ms],
                       decode_ms=[r[2] for r in ms], host_us=dict(zip(("dense", "auto", "decode"), host)),
                       decode_kernels=forced._twell_layer.last_decode_kernels, decode_vs_dense_rel=err)
            records.append(rec)
            print(f"k {k:3d} {dist:5s} M {M:2d}: dense {min(rec['dense_ms']) * 1e3:5.1f}/{max(rec['dense_ms']) * 1e3:5.1f} us "
                  f"auto {min(rec['auto_ms']) * 1e3:5.1f}/{max(rec['auto_ms']) * 1e3:5.1f} "
                  f"decode {min(rec['decode_ms']) * 1e3:5.1f}/{max(rec['decode_ms']) * 1e3:5.1f} ({rec['decode_kernels']}) "
                  f"host {host[0]:4.0f}/{host[1]:4.0f}/{host[2]:4.0f} us err {err:.1e}", flush=True)
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__)
    with open(os.path.join(OUT, "eager_decode_probe.json"), "w") as fh:
        json.dump({"meta": meta, "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
