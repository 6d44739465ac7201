"""Host time of the training ops, step by step, without a profiler (bf16, d 2048, f 5632, k 29
even, W 64).

    python benchmarks/train_host_breakdown.py [OUTDIR] [M ...]

Each step is issued while the GPU sleeps (``torch.cuda._sleep``), so that the host never waits
for it: the wall time of the call is the time to issue it. Bursts of 8 calls, medians of 7 bursts, microseconds per call.
The steps are those of :func:`twell.train_ops._light_forward` and of
``SparseGatedFFNFunction.backward``, called one by one on the same tensors, then whole calls:
the sparse op's forward and backward, the dense op's, dense PyTorch's, and the module's (default
settings). A profiler (cProfile, torch.profiler) inflates Python-heavy steps such as Triton's
launcher; this does not. Writes OUTDIR/train_host_breakdown.json.
"""

from __future__ import annotations

import json
import math
import os
import statistics
import sys
import time

import torch

from twell import train_ops as T
from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.training import LAM, _module_fn
from twell.kernels.heavy_rows import heavy_rows_forward
from twell.kernels.train_ffn import ffn_rows_backward, ffn_rows_forward, ffn_weight_grads, pack_rows
from twell.kernels.train_index import light_unit_counts, unit_index

ARGS = [a for a in sys.argv[1:] if not a.startswith("--")]
OUT = ARGS[0] if ARGS and not ARGS[0].isdigit() else os.environ.get("OUT", "/tmp")
SIZES = [int(a) for a in ARGS if a.isdigit()] or [2048, 16384]
SLEEP = 100_000_000  # cycles: about 50 ms at the H200's clock, far longer than any step's issue


def host_us(fn, burst: int = 8, rounds: int = 7, prepare=None) -> float:
    """Wall time of issuing ``fn()`` while the GPU sleeps, us per call: ``burst`` calls back to
    back (a lone call right after a synchronisation reads several times slower: cold caches on
    the host), median over ``rounds``. ``prepare``: called ``burst`` times before the GPU is
    put to sleep, its results (forwards, finished) handed to the calls, ``fn(item)``."""
    per = []
    for _ in range(rounds + 1):
        items = [prepare() for _ in range(burst)] if prepare is not None else None
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP)
        t0 = time.perf_counter()
        for i in range(burst):
            fn() if items is None else fn(items[i])
        per.append((time.perf_counter() - t0) * 1e6 / burst)
        del items
        torch.cuda.synchronize()
    return statistics.median(per[1:])


def breakdown(M: int) -> dict:
    s = make_ffn(M, 2048, 5632, 29, "even", device="cuda")
    x, wg, wu, wd = (t.detach().requires_grad_(True) for t in (s.x, s.w_gate, s.w_up, s.w_down))
    dy = torch.randn_like(x) / math.sqrt(2048)
    lam = torch.full((), LAM, device="cuda")
    W, f = T.choose_width(29.0), wg.shape[0]
    xd, wgd, wud, wdd = x.detach(), wg.detach(), wu.detach(), wd.detach()
    a = torch.mm(xd, wgd.t())
    cols, g, counts = pack_rows(a, W, **T.PACK_CONFIG)
    per_unit = light_unit_counts(cols, counts, f)
    heavy, n_heavy, hot_mask, info, schedule = T._heavy_and_hot(counts, W, per_unit, f)
    wdt = T._rows_of(wdd)
    y, u, l1_rows = ffn_rows_forward(xd, cols, g, counts, wdt, wud, **T.ROWS_CONFIG)
    c = T._l1_scale(lam, M, x.device)
    dx, du, da = ffn_rows_backward(dy, cols, g, u, counts, wdt, wud, wgd, c, **T.ROWS_CONFIG)
    order, offsets = unit_index(cols, counts, f, None)
    a2 = a.clone()
    l1_heavy = torch.zeros(M, device="cuda")
    steps = {
        "fwd: mm gate": lambda: torch.mm(xd, wgd.t()),
        "fwd: check_args": lambda: T._check_args(xd, wud, wdd, wgd, W),
        "fwd: pack_rows": lambda: pack_rows(a, W, **T.PACK_CONFIG),
        "fwd: light_unit_counts": lambda: light_unit_counts(cols, counts, f),
        "fwd: heavy_and_hot": lambda: T._heavy_and_hot(counts, W, per_unit, f),
        "fwd: to_host": lambda: T._to_host(info),
        "fwd: w_down rows copy": lambda: T._rows_of(wdd),
        "fwd: ffn_rows_forward": lambda: ffn_rows_forward(xd, cols, g, counts, wdt, wud, **T.ROWS_CONFIG),
        "fwd: heavy_rows_forward": lambda: heavy_rows_forward(xd, a2, heavy, n_heavy, y, wdd, wud, **T.HEAVY_CONFIG),
        "fwd: l1 sum": lambda: (l1_rows + l1_heavy).sum() / M,
        "bwd: l1_scale": lambda: T._l1_scale(lam, M, x.device),
        "bwd: ffn_rows_backward": lambda: ffn_rows_backward(dy, cols, g, u, counts, wdt, wud, wgd, c, **T.ROWS_CONFIG),
        "bwd: unit_index": lambda: unit_index(cols, counts, f, None),
        "bwd: ffn_weight_grads": lambda: ffn_weight_grads(order, offsets, xd, dy, g, u, du, da, dtype=wud.dtype, **T.GRADS_CONFIG),
        "empty Triton-free op (torch.zeros(1))": lambda: torch.zeros(1, device="cuda"),
    }
    rec = {"M": M, "steps": {k: host_us(fn) for k, fn in steps.items()}}

    # whole calls: forwards alone, then backwards of forwards finished before the GPU sleeps
    # (the sparse op's backward waits for counts its forward copies to the host)
    F = torch.nn.functional

    def sparse_fwd():
        return T.sparse_gated_ffn(x, wg, wu, wd, W)

    def dense_fwd():
        return T.dense_gated_ffn(x, wg, wu, wd)

    def bare_fwd():
        return F.linear(torch.relu(F.linear(x, wg)) * F.linear(x, wu), wd)

    def bwd(out):
        if isinstance(out, torch.Tensor):
            torch.autograd.grad(out, (x, wg, wu, wd), dy)
        else:
            torch.autograd.grad((out.y, out.l1), (x, wg, wu, wd), (dy, lam))

    module, m = _module_fn(x, wg, wu, wd, dy)
    params = tuple(m.parameters())

    def module_fwd():
        return m(x), m.l1

    def module_bwd(out):
        torch.autograd.grad(out, (x, *params), (dy, lam))

    calls = {}
    for name, fwd in (("sparse op", sparse_fwd), ("dense op", dense_fwd), ("dense PyTorch", bare_fwd)):
        calls[name + " forward"] = host_us(fwd)
        calls[name + " backward"] = host_us(bwd, prepare=fwd)
    calls["module forward"] = host_us(module_fwd)
    calls["module backward"] = host_us(module_bwd, prepare=module_fwd)
    rec["calls"] = calls
    rec["module_path"] = m.last_train_path
    rec["inside_sparse_op"] = inside_sparse_op(sparse_fwd, bwd)
    return rec


WRAPPED = ("_check_args", "_refuse_capture", "pack_rows", "light_unit_counts", "_heavy_and_hot", "_to_host", "_rows_of",
           "ffn_rows_forward", "heavy_rows_forward", "_host_counts", "_l1_scale", "ffn_rows_backward", "unit_index",
           "ffn_weight_grads", "_heavy_backward", "_hot_dense")


def inside_sparse_op(fwd, bwd, burst: int = 8, rounds: int = 5) -> dict:
    """Host time per call of each helper the sparse op calls (twell.train_ops' names wrapped with
    timers), and what is left of the forward's and the backward's time: the op's own lines,
    autograd's machinery, torch.mm."""
    spent: dict = {}

    def timed(name, f):
        def run(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - t0
        return run

    real = {name: getattr(T, name) for name in WRAPPED}
    for name, f in real.items():
        setattr(T, name, timed(name, f))
    try:
        totals = {"forward": host_us(fwd, burst, rounds), "backward": host_us(bwd, burst, rounds, prepare=fwd)}
        spent.clear()
        torch.cuda.synchronize()
        torch.cuda._sleep(SLEEP)
        for _ in range(burst):
            fwd()
        torch.cuda.synchronize()
        outs = [fwd() for _ in range(burst)]
        torch.cuda.synchronize()
        fwd_spent = dict(spent)
        spent.clear()
        torch.cuda._sleep(SLEEP)
        for o in outs:
            bwd(o)
        torch.cuda.synchronize()
        # the forward's helpers ran 2 x burst times above (the burst and the prepared outputs)
        per = {k: v * 1e6 / (2 * burst) for k, v in fwd_spent.items()}
        per.update({k: v * 1e6 / burst for k, v in spent.items()})
    finally:
        for name, f in real.items():
            setattr(T, name, f)
    fwd_names = WRAPPED[:WRAPPED.index("_host_counts")]
    per["forward, rest"] = totals["forward"] - sum(v for k, v in per.items() if k in fwd_names)
    per["backward, rest"] = totals["backward"] - sum(v for k, v in per.items() if k not in fwd_names and "rest" not in k)
    return {"totals": totals, "per_call_us": per}


def main() -> None:
    recs = []
    for M in SIZES:
        rec = breakdown(M)
        recs.append(rec)
        print(f"M {M} (module path {rec['module_path']}), host us:")
        for k, v in {**rec["steps"], **rec["calls"]}.items():
            print(f"  {k:40s} {v:8.1f}")
        print("  inside the sparse op (wrapped helpers, us per call):", rec["inside_sparse_op"]["totals"])
        for k, v in rec["inside_sparse_op"]["per_call_us"].items():
            print(f"    {k:38s} {v:8.1f}")
    with open(os.path.join(OUT, "train_host_breakdown.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), records=recs), fh, indent=1)


if __name__ == "__main__":
    main()
