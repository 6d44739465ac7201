"""Where the split decode kernels' time goes, kernel by kernel, as a model runs them (issue 9).

    OUT=DIR python benchmarks/split_stage_probe.py

At 64 tokens and k 29 the split kernels take about 23.8 us per layer in a chain of eight layers,
against 10.0 us for the cuBLAS gate alone (twelfth session): 16.9 us at no fires plus 3.8 ns per
fire, fitted, never measured apart. Here the same chain (LAYERS layers with their own weights,
one CUDA graph, no flush) is replayed under the PyTorch profiler, and each kernel's GPU time is
averaged per layer: the gate (``_fire_gate_kernel``), the up/down (``_fire_updown_kernel``), the
write-out; the cuBLAS gate product alone and the dense MLP's kernels beside them. Also the
replay's time per layer (CUDA events), so that gaps between kernels show as the difference.
k in {8, 29} even, M in {16, 64}. Writes OUT/split_stage_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os
from collections import defaultdict

import torch

from twell.bench.inference import machine_info
from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import capture

LAYERS = 8
REPLAYS = 20
OUT = os.environ.get("OUT", "/tmp")


def per_layer_kernels(fns) -> tuple[dict, float]:
    """({kernel name: us per layer}, replay us per layer) of ``fns`` captured in one graph."""
    graph = capture(lambda: [fn() for fn in fns])
    for _ in range(5):
        graph.replay()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    end.synchronize()
    replay_us = start.elapsed_time(end) * 1e3 / (REPLAYS * len(fns))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(REPLAYS):
            graph.replay()
        torch.cuda.synchronize()
    times = defaultdict(float)
    for ev in prof.events():
        if ev.device_type == torch.autograd.DeviceType.CUDA:
            times[ev.name[:60]] += ev.device_time_total / (REPLAYS * len(fns))
    del graph
    return dict(sorted(times.items(), key=lambda kv: -kv[1])), replay_us


def main() -> None:
    out = dict(layers=LAYERS, replays=REPLAYS, **machine_info(), records=[])
    for k in (8, 29):
        s = make_ffn(4096, 2048, 5632, k, "even", dtype=torch.bfloat16, device="cuda", seed=k + 23)
        pairs = [_pair(s) for _ in range(LAYERS)]
        dense = [p[0] for p in pairs]
        twell = [p[1] for p in pairs]
        for M in (16, 64):
            x = s.x[:M].contiguous()
            with torch.no_grad():
                for t in twell:
                    _warm(t, x)
                    t.kernel_mode = "decode"
                rec = dict(M=M, k=k)
                for name, fns in (("twell", [lambda m=m: m(x) for m in twell]),
                                  ("dense", [lambda m=m: m(x) for m in dense]),
                                  ("cublas_gate", [lambda m=m: torch.mm(x, m.gate_proj.weight.t()) for m in dense])):
                    kernels, replay = per_layer_kernels(fns)
                    rec[name] = dict(replay_us=replay, kernels_us=kernels)
                    print(f"M {M} k {k} {name}: replay {replay:.1f} us per layer; "
                          + ", ".join(f"{n[:40]} {v:.1f}" for n, v in list(kernels.items())[:4]), flush=True)
                rec["decode_kernels"] = twell[0]._twell_layer.last_decode_kernels
                out["records"].append(rec)
    with open(os.path.join(OUT, "split_stage_probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
