"""Where one compiled MLP call at a small batch spends its time: host, GPU kernels, and whether
inductor's CUDA graphs took the call.

    CASES=1:29:even,64:29:even python benchmarks/compiled_call_stage.py OUTDIR

For each case ``M:k:distribution`` (d 2048, f 5632, bf16, eval mode, no gradients), dense (the
three-``nn.Linear`` PyTorch MLP) and twell (:class:`twell.SparseGatedMLP`, default settings), each
run four ways: eager, replayed from a CUDA graph captured by hand, ``torch.compile(fullgraph=True,
dynamic=True)`` in default mode and in ``mode="reduce-overhead"`` (as ``twell bench compiled``
compiles them). For each: the time per call (``interleaved_ms``, dense and twell in turn), the
host time to issue one call (``host_us``), CALLS calls profiled (GPU kernels: span, busy time,
launches, the kernels by time) and the path twell took. Inductor's reasons for not taking a graph
into CUDA graphs (``perf_hints``) are printed as they come. With HOST_PROFILE=1 it also prints
where the host spends twell's compiled calls (cProfile over 50 calls, functions by own time).

The question it answers: what a compiled call of a few tokens pays beyond the kernels, and
where, when twell's own CUDA graphs run it 2.5 times faster than dense's.

Writes OUTDIR/compiled_call_stage_<gpu>.json; prints a table last.
"""

from __future__ import annotations

import json
import logging
import os
import sys

import torch

from twell.bench.cli import _gpu_tag
from twell.bench.inference import machine_info
from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import capture, host_us, interleaved_ms

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from train_call_stage import profiled  # noqa: E402

D, F = 2048, 5632
MODES = ("eager", "graph", "default", "reduce-overhead")


def callers(dense, twell, x) -> dict:
    """``{(mode, name): fn}`` for each mode of :data:`MODES`, dense and twell, warmed up."""
    fns = {}
    for name, mod in (("dense", dense), ("twell", twell)):
        fns[("eager", name)] = lambda mod=mod: mod(x)
        g = capture(lambda mod=mod: mod(x))
        fns[("graph", name)] = g.replay
        for mode in ("default", "reduce-overhead"):
            c = torch.compile(mod, fullgraph=True, dynamic=True, mode=mode)
            for _ in range(4):  # compile, warm up, record inductor's graphs
                c(x)
            fns[(mode, name)] = lambda c=c: c(x)
    torch.cuda.synchronize()
    return fns


def main(out: str) -> None:
    import torch._dynamo

    torch._logging.set_logs(perf_hints=True)  # "skipping cudagraphs due to ..."
    logging.getLogger("torch._inductor").setLevel(logging.INFO)
    cases = os.environ.get("CASES", "1:29:even,64:29:even")
    info, rows = machine_info(), []
    for case in cases.split(","):
        M, k, dist = case.split(":")
        M, k = int(M), int(k)
        s = make_ffn(max(M, 64), D, F, k, dist, dtype=torch.bfloat16, device="cuda", seed=k + 11)
        dense, twell = _pair(s)
        x = s.x[:M].contiguous()
        torch._dynamo.reset()
        with torch.no_grad():
            _warm(twell, x)
            fns = callers(dense, twell, x)
            for mode in MODES:
                names = ("dense", "twell")
                times = interleaved_ms([fns[(mode, n)] for n in names], calls=200)
                for n, t in zip(names, times):
                    fn = fns[(mode, n)]
                    if n == "twell":
                        fn()
                        torch.cuda.synchronize()
                    rec = dict(M=M, k=k, distribution=dist, mode=mode, variant=n, ms=t, host_us=host_us(fn, calls=20),
                               path=twell.last_path if n == "twell" else None, **profiled(fn), **info)
                    rows.append(rec)
            if os.environ.get("HOST_PROFILE") == "1":
                import cProfile
                import pstats

                for mode in ("default", "reduce-overhead"):
                    fn = fns[(mode, "twell")]
                    prof = cProfile.Profile()
                    prof.enable()
                    for _ in range(50):
                        fn()
                    prof.disable()
                    torch.cuda.synchronize()
                    print(f"== host profile: M {M} k {k} {dist} twell compiled {mode}, 50 calls")
                    pstats.Stats(prof).sort_stats("tottime").print_stats(16)
        del fns, dense, twell, s
        torch._dynamo.reset()
        torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"compiled_call_stage_{_gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
    for r in rows:
        base = next(b for b in rows if (b["M"], b["k"], b["distribution"], b["mode"], b["variant"])
                    == (r["M"], r["k"], r["distribution"], r["mode"], "dense"))
        print(f"M {r['M']:5d} k {r['k']:3d} {r['distribution']:6s} {r['mode']:15s} {r['variant']:6s} {r['ms'] * 1e3:7.1f} us "
              f"({base['ms'] / r['ms']:.2f}x) host {r['host_us']:6.1f} us  GPU span {r['span_us']:6.1f} us kernels "
              f"{r['kernels_us']:6.1f} us in {r['launches']:.0f} launches  path {r['path']}")
        print("      " + "; ".join(f"{n[:40]} {t:.1f}" for n, t in r["top_kernels"][:6]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
