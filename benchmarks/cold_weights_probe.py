"""How should a decode MLP's cold weights be timed? (issues 9 and 8: small batches in CUDA graphs.)

    OUT=DIR python benchmarks/cold_weights_probe.py [M ...]

`triton.testing.do_bench`, which the decode grid used, flushes L2 before each call by zeroing a
256 MB buffer. That leaves L2 full of *dirty* lines: the call's first reads must first write
them back to HBM. In a model the weights of a layer are cold for another reason, the other
layers' weights read since, and those lines are clean. The issue's own figures (dense 31 us,
cuBLAS gate 6.5 us at one token) are far below what the dirty flush gives here (40 and 13.5).

Three ways to time one layer, in CUDA graphs, both sides the same way:

- ``dirty``: the graph of one call, L2 zeroed before each replay (the decode grid until now);
- ``clean``: the same, L2 evicted before each replay by *reading* a 256 MB buffer;
- ``stack``: LAYERS layers with their own copies of the same weights captured in one graph and
  replayed back to back, the time per layer (each layer's weights were evicted by the other
  layers' reads, as in a model's decoding step).

For each (k, distribution) of the decode grid and each M: dense (three nn.Linear), twell with
default settings (warmed up), twell with the decode kernels forced. Writes
OUT/cold_weights_probe.json; prints one line per record.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import capture, chain_graph_ms

OUT = os.environ.get("OUT", "/tmp")
LAYERS = int(os.environ.get("LAYERS", "8"))
REPS = 100


def replay_us(fn, flush: str) -> float:
    """Median microseconds of replays of ``fn`` captured once, L2 zeroed (``"dirty"``) or evicted
    by a read (``"clean"``) before each. (The chain needs no flush: ``chain_graph_ms``.)"""
    graph = capture(fn)
    buf = torch.ones(64 << 20, dtype=torch.float32, device="cuda")  # 256 MB
    total = torch.empty((), device="cuda")
    events = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)) for _ in range(REPS)]
    for _ in range(5):
        graph.replay()
    for start, end in events:
        if flush == "dirty":
            buf.zero_()
        elif flush == "clean":
            torch.sum(buf, dim=0, out=total)
        start.record()
        graph.replay()
        end.record()
    torch.cuda.synchronize()
    out = statistics.median(s.elapsed_time(e) for s, e in events) * 1e3
    del graph, buf
    return out


def main() -> None:
    Ms = [int(a) for a in sys.argv[1:]] or [1, 4, 16, 32, 64, 128, 256]
    records = []
    for k in (8, 29, 56):
        for dist in ("even", "skewed"):
            s = make_ffn(4096, 2048, 5632, k, dist, dtype=torch.bfloat16, device="cuda", seed=k + 23)
            pairs = [_pair(s) for _ in range(LAYERS)]
            dense = [p[0] for p in pairs]
            twell = [p[1] for p in pairs]
            for M in Ms:
                x = s.x[:M].contiguous()
                rec = dict(M=M, k=k, distribution=dist, layers=LAYERS)
                with torch.no_grad():
                    for t in twell:
                        t.kernel_mode = "auto"
                        _warm(t, x)
                    rec["union"] = int(((x.float() @ s.w_gate.float().T) > 0).any(dim=0).sum())
                    for side, mods in (("dense", dense), ("twell", twell), ("decode", twell)):
                        for t in twell:
                            t.kernel_mode = "decode" if side == "decode" else "auto"
                        one = lambda m=mods[0]: m(x)  # noqa: E731
                        rec[f"{side}_dirty_us"] = replay_us(one, "dirty")
                        rec[f"{side}_clean_us"] = replay_us(one, "clean")
                        rec[f"{side}_stack_us"] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in mods])
                        if side != "dense":
                            rec[f"{side}_path"] = twell[0].last_path
                            rec[f"{side}_kernels"] = twell[0]._twell_layer.last_decode_kernels
                    gate = lambda: dense[0].gate_proj(x)  # noqa: E731
                    rec["gate_dirty_us"], rec["gate_clean_us"] = replay_us(gate, "dirty"), replay_us(gate, "clean")
                    rec["gate_stack_us"] = 1e3 * chain_graph_ms([lambda m=m: m.gate_proj(x) for m in dense])
                    ref = dense[0](x).float()
                    rec["decode_rel_vs_dense"] = float((twell[0](x).float() - ref).norm() / ref.norm())
                    for t in twell:
                        t.kernel_mode = "auto"
                records.append(rec)
                r = rec
                print(f"M {M:3d} k {k:2d} {dist:6s} u {r['union']:4d} | dense d/c/s {r['dense_dirty_us']:5.1f} {r['dense_clean_us']:5.1f} "
                      f"{r['dense_stack_us']:5.1f} | twell {r['twell_dirty_us']:5.1f} {r['twell_clean_us']:5.1f} {r['twell_stack_us']:5.1f} "
                      f"({r['twell_path']}) x{r['dense_dirty_us'] / r['twell_dirty_us']:.2f} {r['dense_clean_us'] / r['twell_clean_us']:.2f} "
                      f"{r['dense_stack_us'] / r['twell_stack_us']:.2f} | forced {r['decode_dirty_us']:5.1f} {r['decode_clean_us']:5.1f} "
                      f"{r['decode_stack_us']:5.1f} x{r['dense_stack_us'] / r['decode_stack_us']:.2f} ({r['decode_kernels']}) "
                      f"gate {r['gate_dirty_us']:4.1f} {r['gate_clean_us']:4.1f} {r['gate_stack_us']:4.1f} err {r['decode_rel_vs_dense']:.1e}", flush=True)
            del s, pairs, dense, twell
            torch.cuda.empty_cache()
    meta = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, layers=LAYERS, reps=REPS)
    with open(os.path.join(OUT, "cold_weights_probe.json"), "w") as fh:
        json.dump({"meta": meta, "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
