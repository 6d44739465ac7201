"""Why a training step on the sparse kernels is slower than on dense (0.86x, 0.5b preset) while
each FFN alone is faster: one device call that answers it.

For each variant (dense kernels; sparse kernels) on the same constructed-sparsity model
and batches, it times ``--steps`` training steps (CUDA events over the steps, after warm-up) and
profiles two more with ``torch.profiler``: the top CUDA kernels by self time, the top CPU ops,
the sum of kernel time against the steps' wall time (the gap is the GPU waiting for the host),
and how often the host synchronised (``cudaStreamSynchronize`` / ``cudaMemcpyAsync`` D2H calls).

    python benchmarks/train_step_probe.py --out $OUT [--preset 0.5b] [--k 29] [--steps 20]

Writes ``train_step_probe.json`` and one chrome trace per variant (gzipped) under ``--out``; prints
a short table last. ``--preset tiny --device cpu`` smoke-tests it on a CPU (no CUDA times).
"""

from __future__ import annotations

import argparse
import gzip
import json
import shutil
import time
from pathlib import Path

import torch


def run_variant(name: str, kernels: str, config, state, batches, steps: int, out: Path, device: str,
                lr: float = 0.0):
    from twell.bench.training import sparse_model, train_step
    from twell.nn import sparse_modules

    model = sparse_model(config, state, kernels, device)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, fused=device == "cuda")
    cuda = device == "cuda"
    for i in range(3):
        train_step(model, opt, batches[i % len(batches)])
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(steps):
        train_step(model, opt, batches[i % len(batches)])
    if cuda:
        torch.cuda.synchronize()
    step_ms = (time.perf_counter() - t0) * 1e3 / steps
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    with torch.profiler.profile(activities=acts) as prof:
        t1 = time.perf_counter()
        for i in range(2):
            train_step(model, opt, batches[i % len(batches)])
        if cuda:
            torch.cuda.synchronize()
        wall_ms = (time.perf_counter() - t1) * 1e3 / 2
    events = prof.key_averages()
    attr = "self_device_time_total" if hasattr(events[0], "self_device_time_total") else "self_cuda_time_total"
    kernel_ms = sum(getattr(e, attr) for e in events if e.device_type == torch.autograd.DeviceType.CUDA) / 1e3 / 2
    syncs = {e.key: e.count // 2 for e in events if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                               "cudaMemcpyAsync", "cudaEventSynchronize", "aten::nonzero")}
    top_cuda = sorted(((e.key, getattr(e, attr) / 1e3 / 2, e.count // 2) for e in events), key=lambda t: -t[1])[:25]
    top_cpu = sorted(((e.key, e.self_cpu_time_total / 1e3 / 2, e.count // 2) for e in events), key=lambda t: -t[1])[:25]
    trace = out / f"train_step_trace_{name}.json"
    prof.export_chrome_trace(str(trace))
    with open(trace, "rb") as src, gzip.open(str(trace) + ".gz", "wb") as dst:
        shutil.copyfileobj(src, dst)
    trace.unlink()
    paths = sorted({m.last_train_path for m in sparse_modules(model) if m.last_train_path})
    active = [round(float(m.stats.active_mean), 2) for m in sparse_modules(model)]
    active_max = [int(m.stats.active_max) for m in sparse_modules(model)]
    del model, opt
    if cuda:
        torch.cuda.empty_cache()
    return {"variant": name, "kernels": kernels, "step_ms": step_ms,
            "profiled_step_ms": wall_ms, "kernel_ms_per_step": kernel_ms, "gpu_idle_ms_per_step": wall_ms - kernel_ms,
            "syncs_per_step": syncs, "paths": paths, "active_mean": active, "active_max": active_max,
            "top_cuda_ms_per_step": top_cuda, "top_cpu_self_ms_per_step": top_cpu}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--preset", default="0.5b")
    p.add_argument("--k", type=float, default=29)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=2048)
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--lr", type=float, default=0.0,
                   help="AdamW learning rate; 0 (default) keeps the constructed sparsity, which moving weights lose")
    a = p.parse_args()
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    from twell.bench.training import constructed_state

    vocab = 49152 if a.preset != "tiny" else 256
    g = torch.Generator(device=a.device).manual_seed(3)
    batches = [torch.randint(0, vocab, (a.batch, a.seq + 1), device=a.device, generator=g) for _ in range(4)]
    config, state = constructed_state(a.preset, a.k, torch.cat(batches)[:4, : a.seq], vocab)
    variants = [("dense", "dense"), ("sparse", "sparse")]
    results = []
    for name, kernels in variants:
        results.append(run_variant(name, kernels, config, state, batches, a.steps, out, a.device, a.lr))
        (out / "train_step_probe.json").write_text(json.dumps(results, indent=1))
    print(f"\n{'variant':24} {'step ms':>8} {'kernels ms':>10} {'GPU idle':>9}  syncs per step")
    for r in results:
        print(f"{r['variant']:24} {r['step_ms']:8.1f} {r['kernel_ms_per_step']:10.1f} {r['gpu_idle_ms_per_step']:9.1f}  "
              f"{r['syncs_per_step']}")
    for r in results:
        print(f"\n{r['variant']}: active units per layer {r['active_mean']}, max {r['active_max']}")
        print(f"{r['variant']}: top CUDA kernels (ms per step, calls)")
        for key, ms, n in r["top_cuda_ms_per_step"][:12]:
            print(f"  {ms:8.2f} {n:6} {key[:90]}")


if __name__ == "__main__":
    main()
