"""Where the training ops' time goes at small calls (2048 and 8192 tokens): host time per call,
GPU kernel time per call, and the kernels, for dense PyTorch, twell's dense op and its sparse op
(forward + backward, bf16, d 2048, f 5632, k 29 even).

    python benchmarks/train_small_m_profile.py [OUTDIR] [--host]

Prints, per variant: wall time per call with the GPU idle between calls (synchronised), host
time to issue one call (for the sparse op an upper bound: its backward waits until the GPU has
passed the forward's pack), the sum of its kernels' GPU time, and the ten kernels and host ops
that take longest. (The results of 2026-12-04 summed the ops' entries with their kernels':
their ``gpu_ms`` is about twice the kernels' time.) Writes OUTDIR/train_small_m_profile.json.
``--host``: instead, cProfile of the host's side of 50 calls of each twell op at 2048 tokens.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time

import torch
from torch.profiler import ProfilerActivity, profile

from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.training import LAM, _dense_fn, _sparse_fn
from twell.train_ops import choose_width, dense_gated_ffn

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
OUT = ARGS[0] if ARGS else os.environ.get("OUT", "/tmp")


def variants(M: int):
    s = make_ffn(M, 2048, 5632, 29, "even", device="cuda")
    x, wg, wu, wd = (t.detach().requires_grad_(True) for t in (s.x, s.w_gate, s.w_up, s.w_down))
    dy = torch.randn_like(x) / math.sqrt(2048)
    lam = torch.full((), LAM, device="cuda")

    def dense_op():
        out = dense_gated_ffn(x, wg, wu, wd)
        return torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam))

    return {"dense": _dense_fn(x, wg, wu, wd, dy), "dense_op": dense_op, "sparse_op": _sparse_fn(x, wg, wu, wd, dy, choose_width(29.0))}


def host_profile(M: int = 2048, calls: int = 50) -> None:
    """cProfile of the host's side of ``calls`` calls of each twell op (the GPU runs behind)."""
    import cProfile
    import pstats

    for name, fn in variants(M).items():
        if name == "dense":
            continue
        for _ in range(5):
            fn()
        torch.cuda.synchronize()
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(calls):
            fn()
        pr.disable()
        torch.cuda.synchronize()
        print(f"== {name}, M {M}, {calls} calls")
        pstats.Stats(pr).sort_stats("tottime").print_stats(22)


def main() -> None:
    if "--host" in sys.argv:
        return host_profile()
    out = []
    for M in (2048, 8192):
        for name, fn in variants(M).items():
            for _ in range(5):
                fn()
            torch.cuda.synchronize()
            walls, issue = [], []
            for _ in range(20):
                t0 = time.perf_counter()
                fn()
                issue.append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                walls.append(time.perf_counter() - t0)
            with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
                for _ in range(5):
                    fn()
                torch.cuda.synchronize()
            ev = prof.key_averages()
            # the kernels only: an op's entry (aten::mm) carries its kernels' device time too
            gpu_us = sum(e.self_device_time_total for e in ev if e.device_type == torch.autograd.DeviceType.CUDA) / 5
            top_gpu = sorted(ev, key=lambda e: -e.self_device_time_total)[:10]
            top_cpu = sorted(ev, key=lambda e: -e.self_cpu_time_total)[:10]
            rec = dict(M=M, variant=name, wall_ms=sorted(walls)[10] * 1e3, issue_ms=sorted(issue)[10] * 1e3, gpu_ms=gpu_us / 1e3,
                       top_gpu=[(e.key, e.count // 5, e.self_device_time_total / 5) for e in top_gpu],
                       top_cpu=[(e.key, e.count // 5, e.self_cpu_time_total / 5) for e in top_cpu])
            out.append(rec)
            print(f"M {M:5d} {name:9s} wall {rec['wall_ms']:.3f} ms, host issue {rec['issue_ms']:.3f} ms, kernels {rec['gpu_ms']:.3f} ms", flush=True)
            print("   gpu: " + "; ".join(f"{k[:40]} x{c} {t:.0f}us" for k, c, t in rec["top_gpu"][:6]))
            print("   cpu: " + "; ".join(f"{k[:40]} x{c} {t:.0f}us" for k, c, t in rec["top_cpu"][:8]))
    with open(os.path.join(OUT, "train_small_m_profile.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), records=out), fh, indent=1)


if __name__ == "__main__":
    main()
