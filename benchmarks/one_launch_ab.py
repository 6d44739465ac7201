"""The module's prefill path with the up/down in one launch where its rows are short
(``twell.dispatch.PREFILL_ONE_LAUNCH``) against the two-pass path, beside dense PyTorch (issue 10:
at 4096 tokens the two-pass path's listing and empty launches were about 5% of the call).

    python benchmarks/one_launch_ab.py OUTDIR

For each case ``M:k:distribution`` (CASES, bf16, d 2048, f 5632, ``track_stats`` off): dense,
the module with the flag on and a second module with it off (each with its own eager graphs,
the flag set around every call), timed as the inference grid times them (``bench_ms``, three
alternating rounds, medians); at 4096 tokens also each module captured in a CUDA graph.
Writes OUTDIR/one_launch_ab.json; prints a line per case.
"""

from __future__ import annotations

import json
import os
import statistics
import sys

import torch

from twell import dispatch
from twell.bench.inference import bench_ms, dense_gated, errors, machine_info, reference_fp32
from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import capture

D, F = 2048, 5632


def main() -> None:
    outdir = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
    cases = os.environ.get("CASES", "4096:29:even,8192:29:even,16384:29:even,16384:8:even,16384:29:skewed,"
                                    "32768:29:even,16384:29:heavy")
    out = dict(machine=machine_info(), records=[])
    for case in cases.split(","):
        M, k, dist = case.split(":")
        M, k = int(M), float(k)
        s = make_ffn(M, D, F, k, dist, dtype=torch.bfloat16, device="cuda", seed=int(k) + M + D)
        x = s.x
        mods = {}
        with torch.no_grad():
            for flag in (True, False):
                m = _pair(s)[1]
                m.track_stats = False
                dispatch.PREFILL_ONE_LAUNCH = flag
                _warm(m, x, calls=6)
                mods[flag] = m

            def call(flag):
                def run():
                    dispatch.PREFILL_ONE_LAUNCH = flag
                    return mods[flag](x)
                return run

            fns = {"dense": lambda: dense_gated(x, s.w_gate, s.w_up, s.w_down), "one": call(True), "two": call(False)}
            runs = {n: [] for n in fns}
            for _ in range(3):
                for n, fn in fns.items():
                    runs[n].append(bench_ms(fn, rep=60))
            rec = dict(M=M, k=k, distribution=dist, **{f"{n}_ms": statistics.median(v) for n, v in runs.items()},
                       rounds=runs, rows_short={str(f): mods[f]._twell_layer.rows_short for f in mods},
                       path={str(f): mods[f].last_path for f in mods})
            ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
            for flag, name in ((True, "one"), (False, "two")):
                rec[f"{name}_rel_err"], rec[f"{name}_max_row_err"] = errors(call(flag)(), ref)
            if M <= 4096:
                graphs = {}
                for flag, name in ((True, "one"), (False, "two")):
                    dispatch.PREFILL_ONE_LAUNCH = flag
                    graphs[name] = capture(lambda m=mods[flag]: m(x))
                graphs["dense"] = capture(fns["dense"])
                g_runs = {n: [] for n in graphs}
                for _ in range(3):
                    for n, g in graphs.items():
                        g_runs[n].append(bench_ms(g.replay, rep=60))
                rec.update({f"graph_{n}_ms": statistics.median(v) for n, v in g_runs.items()})
                del graphs
        dispatch.PREFILL_ONE_LAUNCH = True
        out["records"].append(rec)
        line = (f"M {M} k {k:g} {dist}: dense {rec['dense_ms']:.3f}, one launch {rec['one_ms']:.3f} "
                f"({rec['dense_ms'] / rec['one_ms']:.3f}x), two-pass {rec['two_ms']:.3f} ({rec['dense_ms'] / rec['two_ms']:.3f}x)"
                f" rows_short {rec['rows_short']['True']} path {rec['path']['True']} err {rec['one_rel_err']:.1e}")
        if "graph_one_ms" in rec:
            line += (f"; graphs: dense {rec['graph_dense_ms']:.3f}, one {rec['graph_one_ms']:.3f} "
                     f"({rec['graph_dense_ms'] / rec['graph_one_ms']:.3f}x), two {rec['graph_two_ms']:.3f} "
                     f"({rec['graph_dense_ms'] / rec['graph_two_ms']:.3f}x)")
        print(line, flush=True)
        with open(os.path.join(outdir, "one_launch_ab.json"), "w") as fh:
            json.dump(out, fh, indent=1)
        mods.clear()
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
