"""Device experiment: the inference pack's launch shape for the one-pass bit-word kernel
(`twell.kernels.pack_relu`, twenty-fifth session): five (rows, columns per step, warps) shapes at
M 16384 and 131072, k 8 / 29 / 56 even, bf16, d 2048, f 5632; best of two do_bench rounds.

    python benchmarks/infer_pack_shapes_probe.py     (GPU machine, repository root)
"""
import sys

import torch

sys.path.insert(0, "src")
from twell.bench.inference import bench_ms
from twell.bench.synthetic import make_ffn
from twell.kernels import pack_relu
from twell.ops import DEFAULT_COMPRESSION, default_tile
for M, k in [(16384, 29), (16384, 56), (131072, 29), (131072, 56), (131072, 8)]:
    s = make_ffn(M, 2048, 5632, k, "even", device="cuda", seed=1)
    a = torch.mm(s.x, s.w_gate.t())
    out = []
    for rnd in range(2):
        for cfg in [(2, 256, 1), (2, 512, 1), (1, 512, 1), (4, 512, 1), (2, 1024, 1)]:
            out.append((cfg, bench_ms(lambda: pack_relu(a, default_tile(5632), DEFAULT_COMPRESSION, config=cfg))))
    best = {}
    for c, ms in out:
        best[c] = min(ms, best.get(c, 9e9))
    print("infer pack", M, k, " ".join(f"{'x'.join(map(str, c))}:{v:.4f}" for c, v in best.items()), flush=True)
    del s, a
    torch.cuda.empty_cache()
