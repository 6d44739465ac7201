"""Where one training call (forward + backward) of the gated FFN spends its time, at small and
large token counts: GPU kernels, GPU idle, host.

    CASES=1024:29:even,4096:29:even python benchmarks/train_call_stage.py OUTDIR

For each case ``M:k:distribution`` (d 2048, f 5632, bf16) five variants, each forward +
backward of ``y`` for a gradient ``dy``: ``dense`` (three-Linear PyTorch MLP, no L1 term),
``module`` (:class:`twell.SparseGatedMLP`, default settings, its L1 term in the loss),
``plain_module`` (the module on its dense path as PyTorch ops: ``FUSED_DENSE`` off),
``fused_dense`` (:func:`twell.training.ops.dense_gated_ffn`, with the L1 term) and ``sparse``
(:func:`twell.training.ops.sparse_gated_ffn` at the width its mean gives, with the L1 term).
Each is timed call by call in turn with the others (``interleaved_ms``), its host time to issue
one call measured (``host_us``: a burst without synchronising), and CALLS calls profiled one at
a time: the span from the first kernel's start to the last one's end, the kernels' summed time,
and the kernels by total time. The question it answers: where a training call below
``twell.training.path.MIN_SPARSE_TOKENS`` tokens loses to dense PyTorch.

With HOST_PROFILE=1 it also prints, per case, where the host spends a call of ``module``,
of ``plain_module`` and ``fused_dense`` (cProfile over 20 calls, the functions by their own time).

Writes OUTDIR/train_call_stage_<gpu>.json; prints a table last.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
from collections import defaultdict

import torch

from twell.bench.cli import _gpu_tag
from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.timing import host_us, interleaved_ms

CALLS = int(os.environ.get("CALLS", "5"))
D, F = 2048, 5632
LAM = 2e-5


def variants(M: int, k: int, dist: str) -> dict:
    from twell.nn import SparseGatedMLP
    from twell.training.ops import choose_width, dense_gated_ffn, sparse_gated_ffn

    s = make_ffn(M, D, F, k, dist, torch.bfloat16, "cuda", seed=k)
    x = s.x.requires_grad_(True)
    wg, wu, wd = (w.requires_grad_(True) for w in (s.w_gate, s.w_up, s.w_down))
    dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16) / math.sqrt(D)
    lam = torch.full((), LAM, device="cuda")
    F_ = torch.nn.functional
    with torch.no_grad():
        width = choose_width(float((torch.mm(x, wg.t()) > 0).sum(1).float().mean()), None, F)

    def dense():
        y = F_.linear(torch.relu(F_.linear(x, wg)) * F_.linear(x, wu), wd)
        return torch.autograd.grad(y, (x, wg, wu, wd), dy)

    def op(fn):
        def run():
            out = fn()
            return torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam))
        return run

    m = SparseGatedMLP(D, F, device="cuda", dtype=torch.bfloat16)
    for lin, w in ((m.gate_proj, wg), (m.up_proj, wu), (m.down_proj, wd)):
        lin.weight = torch.nn.Parameter(w.detach())
    m.train()
    params = tuple(m.parameters())

    def module():
        y = m(x)
        return torch.autograd.grad((y, m.l1), (x, *params), (dy, lam))

    def plain_module():  # the module's dense path as PyTorch ops (train_path.FUSED_DENSE off)
        from twell.training import path as train_path

        train_path.FUSED_DENSE = False
        try:
            return module()
        finally:
            train_path.FUSED_DENSE = True

    for _ in range(4):
        module()
    torch.cuda.synchronize()
    return {"dense": dense, "module": module, "plain_module": plain_module,
            "fused_dense": op(lambda: dense_gated_ffn(x, wg, wu, wd)),
            "sparse": op(lambda: sparse_gated_ffn(x, wg, wu, wd, width)),
            "_module": m, "_width": width}


def profiled(fn) -> dict:
    """CALLS calls of ``fn``, each under its own profiler, after a synchronisation."""
    calls = []
    for _ in range(CALLS):
        torch.cuda.synchronize()
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        evs = [ev for ev in prof.events() if ev.device_type == torch.autograd.DeviceType.CUDA]
        calls.append(sorted(evs, key=lambda e: e.time_range.start))
    spans = [c[-1].time_range.end - c[0].time_range.start for c in calls]
    busy = [sum(e.time_range.end - e.time_range.start for e in c) for c in calls]
    by_name: dict = defaultdict(float)
    for c in calls:
        for e in c:
            by_name[e.name[:80]] += (e.time_range.end - e.time_range.start) / len(calls)
    top = sorted(by_name.items(), key=lambda t: -t[1])[:12]
    return dict(span_us=statistics.median(spans), kernels_us=statistics.median(busy),
                launches=statistics.median(len(c) for c in calls), top_kernels=top)


def main(out: str) -> None:
    cases = os.environ.get("CASES", "1024:29:even,4096:29:even,16384:29:even")
    info, rows = machine_info(), []
    for case in cases.split(","):
        M, k, dist = case.split(":")
        v = variants(int(M), int(k), dist)
        m = v.pop("_module")
        width = v.pop("_width")
        names = list(v)
        times = interleaved_ms([v[n] for n in names], calls=30, warmup=3)
        if os.environ.get("HOST_PROFILE") == "1":
            import cProfile
            import pstats

            for n in ("module", "plain_module", "fused_dense"):
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(20):
                    v[n]()
                prof.disable()
                torch.cuda.synchronize()
                print(f"== host profile: M {M} k {k} {dist} {n}, 20 calls")
                pstats.Stats(prof).sort_stats("tottime").print_stats(14)
        for n, t in zip(names, times):
            rec = dict(M=int(M), k=int(k), distribution=dist, variant=n, ms=t, host_us=host_us(v[n], calls=10),
                       width=width, module_path=m.last_train_path, **profiled(v[n]), **info)
            rows.append(rec)
        del v, m
        torch.cuda.empty_cache()
    os.makedirs(out, exist_ok=True)
    path = os.path.join(out, f"train_call_stage_{_gpu_tag()}.json")
    with open(path, "w") as fh:
        json.dump(rows, fh, indent=1)
    for r in rows:
        base = next(b for b in rows if (b["M"], b["k"], b["distribution"], b["variant"]) == (r["M"], r["k"], r["distribution"], "dense"))
        print(f"M {r['M']:6d} k {r['k']:3d} {r['distribution']:6s} {r['variant']:12s} {r['ms']:7.3f} ms "
              f"({base['ms'] / r['ms']:.2f}x) host {r['host_us']:7.0f} us  GPU span {r['span_us']:7.0f} us kernels "
              f"{r['kernels_us']:7.0f} us in {r['launches']:.0f} launches  path {r['module_path']}")
        if r["variant"] in ("module", "fused_dense") or r["M"] <= 4096:  # (plain_module: PyTorch's kernels)
            print("      " + "; ".join(f"{n[:40]} {t:.0f}" for n, t in r["top_kernels"][:8]))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "benchmarks/results")
