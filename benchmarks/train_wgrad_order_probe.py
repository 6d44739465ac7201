"""The weight-gradient kernel's schedule alone: programs in unit order against longest first,
by an exact sort of the units' slot counts (``longest_first`` below, PyTorch's sort; the first
run) and by the half-octave schedule that ``twell.kernels.train_index.heavy_and_hot`` writes
(what ships), kernel time (CUDA events, L2 flushed by do_bench) and the sort's GPU and host
time, on even, skewed and heavy layers (M 16384, d 2048, f 5632, bf16; hot units left out as
the op leaves them out).

Why: in the fifty-fifth session's module A/B (benchmarks/train_skewed_ab.py) longest first took
0.1 to 0.2 ms off skewed layers with long warm units, but added about as much to even k 8 and
heavy k 29, whose units are all about as long.

    python benchmarks/train_wgrad_order_probe.py [OUTDIR]
"""

from __future__ import annotations

import json
import os
import sys
import time

import torch

from twell import train_ops
from twell.bench.inference import bench_ms, machine_info
from twell.bench.training import stage_tensors
from twell.kernels import train_ffn as K
from twell.kernels.train_index import heavy_and_hot, light_unit_counts, unit_index

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
D, F = 2048, 5632
CASES = [(16384, 8, "even"), (16384, 29, "even"), (16384, 29, "heavy"), (16384, 8, "skewed"), (16384, 29, "skewed"),
         (16384, 56, "skewed")]


def longest_first(offsets: torch.Tensor) -> torch.Tensor:
    """The units in decreasing order of their slot counts, ties by unit (PyTorch's stable sort)."""
    return torch.sort(offsets[1:] - offsets[:-1], descending=True, stable=True).indices


def host_us(fn, calls: int = 200) -> float:
    torch.cuda.synchronize()
    torch.cuda._sleep(50_000_000)  # the GPU busy: the wall time is the host's
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def one(M, k, dist) -> dict:
    t = stage_tensors(M, k, dist, D, F)
    x, wu, dy, W, cols, g, cnt, u, du, da = t.x, t.wu, t.dy, t.W, t.cols, t.g, t.cnt, t.u, t.du, t.da
    per = light_unit_counts(cols, cnt, F)
    rec = dict(M=M, k=k, dist=dist, width=W)
    for name, share, factor in (("old limit", 0.0, 8.0), ("new limit", 0.02, 2.0)):
        limit = max(float(train_ops.HOT_MIN), share * M)
        _, _, hot, info, schedule = heavy_and_hot(cnt, W, per, limit, factor)
        order, offsets = unit_index(cols, cnt, F, hot)
        units = longest_first(offsets)
        cfg = dict(train_ops.GRADS_CONFIG)
        t_unit = bench_ms(lambda: K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, **cfg))
        t_lf = bench_ms(lambda: K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, units=units, **cfg))
        t_sched = bench_ms(lambda: K.ffn_weight_grads(order, offsets, x, dy, g, u, du, da, dtype=wu.dtype, units=schedule, **cfg))
        per_unit = (offsets[1:] - offsets[:-1]).float()
        rec[name] = dict(n_hot=int(info[1]), hot_slots=int(info[2]), max_unit=float(per_unit.max()), mean_unit=float(per_unit.mean()),
                         unit_order_ms=t_unit, longest_first_ms=t_lf, schedule_ms=t_sched, sort_ms=bench_ms(lambda: longest_first(offsets)),
                         sort_host_us=host_us(lambda: longest_first(offsets)),
                         heavy_and_hot_ms=bench_ms(lambda: heavy_and_hot(cnt, W, per, limit, factor)),
                         heavy_and_hot_host_us=host_us(lambda: heavy_and_hot(cnt, W, per, limit, factor)))
        r = rec[name]
        print(f"M {M} k {k} {dist} W {W} {name}: hot {r['n_hot']} ({r['hot_slots']} slots), longest unit {r['max_unit']:.0f} "
              f"(mean {r['mean_unit']:.0f}); weight grads unit order {t_unit:.3f} ms, longest first {t_lf:.3f}, schedule {t_sched:.3f}; "
              f"sort {r['sort_ms'] * 1000:.0f} us GPU, {r['sort_host_us']:.0f} us host; heavy_and_hot {r['heavy_and_hot_ms'] * 1000:.0f} us GPU, "
              f"{r['heavy_and_hot_host_us']:.0f} us host", flush=True)
    return rec


def main() -> None:
    recs = [one(*c) for c in CASES]
    with open(os.path.join(OUT, "train_wgrad_order_probe.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), records=recs), fh, indent=1)


if __name__ == "__main__":
    main()
