"""Where one prefill call of the module spends its GPU time, kernel by kernel.

    CASES=4096:29:even:eager,16384:29:even:eager python benchmarks/prefill_stage.py OUTDIR

For each case ``M:k:distribution:mode`` (mode ``eager``, or ``graph``: the call captured in a
CUDA graph and replayed) at d 2048, f 5632, bf16, ``track_stats`` off: the module and dense
PyTorch timed as the inference grid times them (``bench_ms``, three alternating rounds,
medians), then CALLS calls of each profiled one at a time, each after a 256 MB L2 flush and a
synchronisation. Per call: the span from the first kernel's start to the last one's end, the
kernels' summed time (the span less it is the GPU idle inside the call: launch gaps, host
waits) and each kernel's time. The question it answers: of the module's time at 4096 and 16384
tokens, how much is kernels and how much gaps, and which small kernels (zero fills, lists,
launches with nothing to do) a shorter chain would drop.

Writes OUTDIR/prefill_stage_<gpu>.json; prints a table last.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from collections import defaultdict

import torch

from twell.bench.cli import _gpu_tag
from twell.bench.inference import bench_ms, dense_gated, machine_info
from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import capture

CALLS = int(os.environ.get("CALLS", "8"))
D, F = 2048, 5632
FLUSH_NAME = "FillFunctor<double>"  # the flush's kernel; nothing in a call fills float64


def profiled_calls(fn, flush) -> list[list[tuple[str, float, float]]]:
    """CALLS calls of ``fn``, each after ``flush()`` and a sync: per call, its kernels as
    (name, start us, duration us) in start order."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        for _ in range(CALLS):
            flush()
            torch.cuda.synchronize()
            fn()
            torch.cuda.synchronize()
    kernels = sorted(((ev.name, ev.time_range.start, ev.time_range.end - ev.time_range.start)
                      for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA),
                     key=lambda t: t[1])
    calls, cur = [], None
    for name, start, dur in kernels:
        if FLUSH_NAME in name:
            cur = []
            calls.append(cur)
        elif cur is not None:
            cur.append((name, start, dur))
    return [c for c in calls if c]


def summary(calls) -> dict:
    """Medians over calls of the span, the kernels' sum and each kernel's time (us)."""
    spans = [c[-1][1] + c[-1][2] - c[0][1] for c in calls]
    busy = [sum(k[2] for k in c) for c in calls]
    per = defaultdict(list)
    for c in calls:
        seen = defaultdict(float)
        for name, _, dur in c:
            seen[name[:90]] += dur
        for name, dur in seen.items():
            per[name].append(dur)
    kernels = {n: statistics.median(v) for n, v in per.items()}
    return dict(span_us=statistics.median(spans), busy_us=statistics.median(busy),
                launches=statistics.median(len(c) for c in calls),
                kernels_us=dict(sorted(kernels.items(), key=lambda kv: -kv[1])))


def main() -> None:
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
    cases = os.environ.get("CASES", "4096:29:even:eager,4096:29:even:graph,16384:29:even:eager,131072:29:skewed:eager")
    flush_buf = torch.empty(32 * 2**20, dtype=torch.float64, device="cuda")
    flush = lambda: flush_buf.fill_(1.0)  # noqa: E731
    out = dict(machine=machine_info(), calls=CALLS, records=[])
    for case in cases.split(","):
        M, k, dist, mode = case.split(":")
        M, k = int(M), float(k)
        s = make_ffn(M, D, F, k, dist, dtype=torch.bfloat16, device="cuda", seed=int(k) + M + D)
        x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
        with torch.no_grad():
            mod = _pair(s)[1]
            mod.track_stats = False
            _warm(mod, x, calls=6)  # the estimate, then (skewed, eager) the hot set
            fns = {"dense": lambda: dense_gated(x, wg, wu, wd), "twell": lambda: mod(x)}
            if mode == "graph":
                graphs = {n: capture(fn) for n, fn in fns.items()}
                fns = {n: g.replay for n, g in graphs.items()}
            runs = defaultdict(list)
            for _ in range(3):
                for name, fn in fns.items():
                    runs[name].append(bench_ms(fn, rep=60))
            rec = dict(M=M, k=k, distribution=dist, mode=mode, path=mod.last_path,
                       hot_units=mod._twell_layer.last_hot_units,
                       **{f"{n}_ms": statistics.median(v) for n, v in runs.items()},
                       **{f"{n}_ms_rounds": v for n, v in runs.items()})
            rec["speedup"] = rec["dense_ms"] / rec["twell_ms"]
            for name, fn in fns.items():
                rec[name] = summary(profiled_calls(fn, flush))
        out["records"].append(rec)
        t = rec["twell"]
        print(f"M {M} k {k:g} {dist} {mode}: dense {rec['dense_ms']:.3f} ms, twell {rec['twell_ms']:.3f} ms "
              f"({rec['speedup']:.3f}x, {rec['path']}, hot {rec['hot_units']}); twell span {t['span_us']:.1f} us, "
              f"kernels {t['busy_us']:.1f} us in {t['launches']:g} launches; dense span {rec['dense']['span_us']:.1f}, "
              f"kernels {rec['dense']['busy_us']:.1f}", flush=True)
        for name, us in t["kernels_us"].items():
            print(f"    {us:8.1f} us  {name}", flush=True)
        with open(os.path.join(outdir, f"prefill_stage_{_gpu_tag()}.json"), "w") as fh:
            json.dump(out, fh, indent=1)


if __name__ == "__main__":
    main()
