"""Where an eager small-batch call of the twell module spends host time, against the dense
module (issue 8: eager speedup at M <= 64 reads 0.83x to 0.92x while the GPU work is the same).

    python benchmarks/host_probe.py OUTDIR [M ...]

For each M (default 1 and 16): eager medians (do_bench, three rounds), host time per call, and
cProfile / torch.profiler tables of 2000 calls of each module (200 above 64 tokens, so that the
launch queue never fills; no sync inside). Writes
OUTDIR/host_probe.txt; prints it too.
"""

from __future__ import annotations

import cProfile
import io
import os
import pstats
import sys

import torch
import torch.nn.functional as F

from twell.bench.runtime import _pair
from twell.bench.synthetic import make_ffn
from twell.bench.timing import eager_ms, host_us

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
lines: list[str] = []


def log(s: str = "") -> None:
    print(s, flush=True)
    lines.append(s)


def main() -> None:
    Ms = [int(a) for a in sys.argv[2:]] or [1, 16]
    s = make_ffn(max(64, *Ms), 2048, 5632, 29, "even", dtype=torch.bfloat16, device="cuda", seed=40)
    dense, twell = _pair(s)
    wg, wu, wd = dense.gate_proj.weight, dense.up_proj.weight, dense.down_proj.weight
    for M in Ms:
        calls = 2000 if M <= 64 else 200
        x = s.x[:M].contiguous()
        with torch.no_grad():
            for _ in range(5):
                twell(x)
                torch.cuda.synchronize()
            fns = {
                "dense": lambda: dense(x),
                "twell": lambda: twell(x),
                "bare_ops": lambda: F.linear(F.linear(x, wu).mul_(F.linear(x, wg).relu_()), wd),
                "layer_run": lambda: twell._twell_layer.run(x, twell.gate_proj.weight, twell.down_proj.weight, twell.up_proj.weight),
            }
            for rnd in range(3):
                log(f"M={M} round {rnd}: " + "  ".join(f"{n} eager {eager_ms(fn) * 1e3:6.1f} us host {host_us(fn):6.1f} us" for n, fn in fns.items()))
            log(f"path {twell.last_path}")
            for name in ("dense", "twell"):
                fn = fns[name]
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(calls):
                    fn()
                prof.disable()
                torch.cuda.synchronize()
                buf = io.StringIO()
                pstats.Stats(prof, stream=buf).sort_stats("tottime").print_stats(22)
                log(f"--- cProfile {name} M={M} ({calls} calls)")
                log(buf.getvalue()[-4000:])
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as p:
                    for _ in range(min(calls, 200)):
                        fn()
                torch.cuda.synchronize()
                log(f"--- torch.profiler {name} M={M} ({min(calls, 200)} calls)")
                log(p.key_averages().table(sort_by="self_cpu_time_total", row_limit=18))
    with open(os.path.join(OUT, "host_probe.txt"), "w") as fh:
        fh.write("\n".join(lines))


if __name__ == "__main__":
    main()
