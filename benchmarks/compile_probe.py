"""Why is a compiled twell stack slower than the eager one? (GPU; one call of the device tool.)

Four residual MLP layers at M = 16384 (twell.bench.runtime.compile_compare's stack), eager and
``torch.compile(fullgraph=True)``: CUDA time per op from torch.profiler, host time per forward,
and peak memory, for twell; prints the top ops of each so a copy or an extra pass shows up.
Usage: python benchmarks/compile_probe.py [OUTDIR]
"""

import json
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from twell.bench.runtime import _warm, residual_stacks
from twell.bench.timing import eager_ms

out_dir = sys.argv[1] if len(sys.argv) > 1 else "."
(_, model), x = residual_stacks(16384, 4, 29)  # the twell stack

result = {}
with torch.no_grad():
    for m in model.mlps:
        _warm(m, x, 1)
    compiled = torch.compile(model, fullgraph=True)
    for name, fn in (("eager", lambda: model(x)), ("compiled", lambda: compiled(x))):
        for _ in range(20):
            fn()
        torch.cuda.synchronize()
        ms = eager_ms(fn)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(5):
            fn()
        host_ms = (time.perf_counter() - t0) / 5 * 1e3
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        fn()
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated()
        paths = [m.last_path for m in model.mlps]
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
        table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25, max_name_column_width=70)
        result[name] = dict(ms=ms, host_issue_ms=host_ms, peak_bytes=peak, paths=paths)
        print(f"== {name}: {ms:.3f} ms, host {host_ms:.3f} ms to issue, peak {peak / 2**20:.0f} MiB, paths {paths}")
        print(table)
        with open(os.path.join(out_dir, f"compile_probe_{name}.txt"), "w") as fh:
            fh.write(table)
with open(os.path.join(out_dir, "compile_probe.json"), "w") as fh:
    json.dump(result, fh, indent=1)
