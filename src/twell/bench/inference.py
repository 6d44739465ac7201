"""Inference FFN benchmark: dense PyTorch against the TwELL kernels, side by side.

For every (M, d, f, k, distribution) it records, in one flat dict:

- ``dense_ms``: the dense bf16 PyTorch gated MLP (three cuBLAS matmuls, ReLU, product);
- ``twell_ms``: :class:`twell.SparseGatedMLP` as shipped (``kernel_mode="auto"``: it picks
  kernels or dense from the sparsity of its previous calls), ``track_stats=False``; the two
  are timed in alternation, ``ROUNDS`` times each (``dense_ms_rounds``, ``twell_ms_rounds``),
  and each is the median of its rounds;
- ``kernels_ms``: the TwELL kernels forced (:func:`twell.inference.ops.twell_gated_mlp`, prepared weights);
- ``gate_ms`` (cuBLAS gate alone), ``pack_ms`` (pack pass alone), ``gate_pack_ms`` (both),
  ``updown_ms`` (up/down from TwELL alone, at the module's launch shape and with ``pre`` as
  its scratch, as the module calls it);
- ``rel_err`` (the module's output against an fp32 reference over the whole output),
  ``max_row_err`` / ``dense_max_row_err`` (largest per-row relative error of twell and of dense
  bf16 against the same reference), ``kernels_rel_err`` / ``kernels_max_row_err`` (forced kernels);
- ``k_measured`` (mean active units per token), ``max_row_nnz``, ``overflow_tiles``;
- ``gpu``, ``torch``, ``triton``, ``date``.

Times are medians of ``triton.testing.do_bench`` (CUDA events, after warm-up; it clears the
L2 cache before each run, so weights start in HBM as they would after another layer ran).
"""

from __future__ import annotations

import datetime
import math
import statistics
import time
from typing import Callable, Iterable, Optional

import torch

from .synthetic import make_ffn

# dense / twell alternations per grid record
ROUNDS = 3

__all__ = ["bench_ms", "errors", "run_grid", "run_variants", "best_config", "break_even_density", "machine_info"]


def bench_ms(fn: Callable[[], object], rep: int = 100, warmup: int = 25, min_reps: int = 10) -> float:
    """Median milliseconds of ``fn`` by ``triton.testing.do_bench``, over at least ``min_reps``
    timed calls: do_bench sizes its repetitions from ``rep`` milliseconds, which for a 27 ms
    call would be two samples, too few for a median to mean anything."""
    import triton.testing

    if torch.cuda.is_available():
        fn()  # warm (compilation, allocator), then one timed call to size the repetitions
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        rep = max(rep, int(min_reps * start.elapsed_time(end)) + 1)
    try:
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, return_mode="median"))
    except TypeError:  # older Triton: no return_mode
        return float(triton.testing.do_bench(fn, warmup=warmup, rep=rep, quantiles=[0.5])[0])


def machine_info() -> dict:
    import triton

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu",
        "torch": torch.__version__,
        "triton": triton.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ"),
    }


def reference_fp32(x, w_gate, w_up, w_down, chunk: int = 32768) -> torch.Tensor:
    """fp32 gated MLP of the (bf16) inputs, in row chunks to bound memory."""
    out = torch.empty(x.shape[0], x.shape[1], dtype=torch.float32, device=x.device)
    wg, wu, wd = w_gate.float(), w_up.float(), w_down.float()
    for s in range(0, x.shape[0], chunk):
        xs = x[s : s + chunk].float()
        out[s : s + chunk] = (torch.relu(xs @ wg.T) * (xs @ wu.T)) @ wd.T
    return out


def errors(y: torch.Tensor, ref: torch.Tensor) -> tuple[float, float]:
    """``(||y - ref|| / ||ref||, max over rows of ||y_m - ref_m|| / ||ref_m||)``.

    Rows whose reference is (near) zero are measured against a thousandth of the rms row norm,
    so an all-zero row must come out (near) zero."""
    diff = (y.float() - ref).pow(2).sum(dim=1)
    rn = ref.pow(2).sum(dim=1)
    rel = math.sqrt(float(diff.sum()) / max(float(rn.sum()), 1e-30))
    floor = 1e-3 * float(rn.mean().sqrt()) + 1e-30
    row = (diff.sqrt() / rn.sqrt().clamp(min=floor)).max()
    if torch.isnan(y).any():
        return float("nan"), float("nan")
    return rel, float(row)


def dense_gated(x, w_gate, w_up, w_down):
    return torch.nn.functional.linear(torch.relu(torch.nn.functional.linear(x, w_gate)) * torch.nn.functional.linear(x, w_up), w_down)


# The published kernels (the paper's release), timed side by side with dense PyTorch in one
# process on this project's H200 (bf16, d 2048, f 5632, same
# weights and inputs, three alternating rounds, medians): (M, distribution, k asked) ->
# (dense ms, published ms, note). Reference constants: the published code is not part of this
# repository, and the benchmark does not rerun it.
PUBLISHED_H200: dict[tuple[int, str, int], tuple[float, float, str]] = {
    (131072, "even", 8): (13.83, 6.12, ""),
    (131072, "even", 29): (13.93, 8.70, ""),
    (131072, "even", 56): (13.94, 11.92, ""),
    (131072, "skewed", 29): (13.83, 7.03, ""),
    (131072, "skewed", 56): (13.93, 8.62, ""),
    (131072, "heavy", 29): (13.95, 10.09, "1260 rows wrong (overflowed tiles dropped)"),
    (16384, "even", 29): (1.78, 1.08, ""),
    (4096, "even", 29): (0.43, 0.30, ""),
}


def add_published(records: list[dict]) -> list[dict]:
    """Give the records of d 2048, f 5632 that :data:`PUBLISHED_H200` covers the published
    kernels' reference figures: ``published_dense_ms``, ``published_ms``, ``published_speedup``
    (their time against the dense time of their own run) and ``published_note``. Returns the
    records (changed in place)."""
    for r in records:
        ref = PUBLISHED_H200.get((r.get("M"), r.get("distribution"), r.get("k")))
        if ref is None or (r.get("d"), r.get("f")) != (2048, 5632):
            continue
        dense_ms, ms, note = ref
        r.update(published_dense_ms=dense_ms, published_ms=ms, published_speedup=dense_ms / ms, published_note=note)
    return records


def run_grid(
    shapes: Iterable[tuple[int, int]],
    Ms: Iterable[int],
    ks: Iterable[float],
    distributions: Iterable[str],
    *,
    kernel_k_limit: Optional[Callable[[int, int, float], bool]] = None,
    rep: int = 100,
    log: Callable[[str], None] = print,
    device: str = "cuda",
    partial_path: Optional[str] = None,
) -> list[dict]:
    """Benchmark every combination; see the module docstring for the record fields.

    ``kernel_k_limit(M, f, k)`` says whether to time the forced kernels and their stages (they
    take seconds where the layer is dense); the module (``twell_ms``) is always timed.
    """
    from .. import SparseGatedMLP
    from ..kernels import OverflowCounters, ffn_from_twell, pack_relu
    from ..kernels import gate_pack, updown
    from ..inference.dispatch import LayerState as _KernelPath
    from ..inference.ops import DEFAULT_COMPRESSION, default_tile, prepare_gated_weights, twell_gated_mlp

    info = machine_info()
    records = []
    for d, f in shapes:
        for M in Ms:
            for dist in distributions:
                for k in ks:
                    if dist == "skewed" and k > 0.3 * f:
                        log(f"skip skewed k={k}: 30% dead units leave at most {0.35 * f:.0f}")
                        continue
                    t0 = time.time()
                    s = make_ffn(M, d, f, k, dist, dtype=torch.bfloat16, device=device, seed=int(k) + M + d)
                    x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
                    tile = default_tile(f)
                    cap = _KernelPath.max_units(d)
                    rec = dict(M=M, d=d, f=f, k=k, distribution=dist, tile=tile, compression=DEFAULT_COMPRESSION,
                               pack_config="bits " + "x".join(map(str, gate_pack.bits_config(M))),
                               max_density=_KernelPath.DEFAULT_MAX_DENSITY,
                               max_units=cap if cap < float("inf") else None,
                               limit=_KernelPath.limit(f, None, d))  # the layer's default break-even at this shape
                    ref = reference_fp32(x, wg, wu, wd)
                    with torch.no_grad():
                        y_dense = dense_gated(x, wg, wu, wd)
                        rec["dense_rel_err"], rec["dense_max_row_err"] = errors(y_dense, ref)
                        del y_dense

                        mod = SparseGatedMLP(d, f, device=device, dtype=torch.bfloat16).eval()
                        mod.gate_proj.weight.copy_(wg)
                        mod.up_proj.weight.copy_(wu)
                        mod.down_proj.weight.copy_(wd)
                        mod.track_stats = False
                        for _ in range(3):  # let the layer's estimate arrive
                            mod(x)
                            torch.cuda.synchronize()
                        # dense and twell timed in alternation, ROUNDS times each, so that drift
                        # of the GPU's clocks weighs on both; each is the median of its rounds
                        runs = {"dense": [], "twell": []}
                        for _ in range(ROUNDS):
                            runs["dense"].append(bench_ms(lambda: dense_gated(x, wg, wu, wd), rep=rep))
                            runs["twell"].append(bench_ms(lambda: mod(x), rep=rep))
                        for name, ms in runs.items():
                            rec[f"{name}_ms"] = statistics.median(ms)
                            rec[f"{name}_ms_rounds"] = ms
                        rec["twell_path"] = mod.last_path  # the path of the last timed call
                        # the error of the path the timed calls took (the layer's state moves while
                        # they run: an estimate, a hot set)
                        rec["rel_err"], rec["max_row_err"] = errors(mod(x), ref)
                        rec["hot_units"] = mod._twell_layer.last_hot_units  # (dispatch.HOT_UNITS)
                        rec["twell_cost"] = mod._twell_layer.cost(M)
                        # the up/down shape the module's prefill calls took (it follows the estimate)
                        split = updown.splits(M, True, d=d)
                        lay = mod._twell_layer
                        rec["token_config"] = "x".join(map(str, updown.default_config(d, lay.k_est, split=split, rms_k=lay.k_rms)))
                        rec["updown_kernel"] = "split" if split else "token"

                        pre = torch.mm(x, wg.T)
                        g = pack_relu(pre, tile, DEFAULT_COMPRESSION)
                        counts = g.counts
                        nnz = counts.sum(dim=1, dtype=torch.int64)
                        rec["k_measured"] = float(nnz.float().mean())
                        rec["max_row_nnz"] = int(nnz.max())
                        rec["overflow_tiles"] = int((counts > g.slots).sum())
                        rec["overflow_rows"] = int((counts > g.slots).any(dim=1).sum())
                        del pre, g
                        if kernel_k_limit is None or kernel_k_limit(M, f, k):
                            w = prepare_gated_weights(wu, wd)
                            krep = rep if k <= 300 else max(5, rep // 10)
                            y_k = twell_gated_mlp(x, wg, wu, wd, weights=w)
                            rec["kernels_rel_err"], rec["kernels_max_row_err"] = errors(y_k, ref)
                            del y_k
                            rec["kernels_ms"] = bench_ms(lambda: twell_gated_mlp(x, wg, wu, wd, weights=w), rep=krep)
                            rec["gate_ms"] = bench_ms(lambda: torch.mm(x, wg.T), rep=rep)
                            pre = torch.mm(x, wg.T)
                            rec["pack_ms"] = bench_ms(lambda: pack_relu(pre, tile, DEFAULT_COMPRESSION), rep=rep)
                            rec["gate_pack_ms"] = bench_ms(lambda: pack_relu(torch.mm(x, wg.T), tile, DEFAULT_COMPRESSION), rep=rep)
                            g = pack_relu(pre, tile, DEFAULT_COMPRESSION)
                            c = OverflowCounters.zeros(x.device)
                            be, nw = (int(v) for v in rec["token_config"].split("x"))  # the module's shape
                            # as the module calls it: pre is scratch (rows computed whole overwrite
                            # theirs with h; the rows listed and the work come from g, not pre's values)
                            rec["updown_ms"] = bench_ms(lambda: ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre, counters=c,
                                                                               block_e=be, num_warps=nw, pre_writable=True),
                                                        rep=krep)
                            pairs = rec["k_measured"] * M
                            rec["updown_pair_GBps"] = pairs * 4 * d / (rec["updown_ms"] * 1e6)
                            del pre, g, w
                        rec["speedup"] = rec["dense_ms"] / rec["twell_ms"]
                        if "kernels_ms" in rec:
                            rec["kernels_speedup"] = rec["dense_ms"] / rec["kernels_ms"]
                    rec.update(info)
                    records.append(rec)
                    if partial_path:
                        import json

                        with open(partial_path, "a") as fh:
                            fh.write(json.dumps(rec) + "\n")
                    del s, x, wg, wu, wd, ref, mod
                    torch.cuda.empty_cache()
                    log(
                        f"M={M} d={d} f={f} k={k:g} {dist:6s} kmeas={rec['k_measured']:.1f} dense={rec['dense_ms']:.2f} "
                        f"twell={rec['twell_ms']:.2f} ({rec['twell_path']}) x{rec['speedup']:.2f} "
                        f"kern={rec.get('kernels_ms', float('nan')):.2f} gp={rec.get('gate_pack_ms', float('nan')):.2f} "
                        f"ud={rec.get('updown_ms', float('nan')):.2f} err={rec['rel_err']:.1e} row={rec['max_row_err']:.1e}/"
                        f"{rec['dense_max_row_err']:.1e} ovf={rec['overflow_tiles']} [{time.time() - t0:.1f}s]"
                    )
    return records


def run_variants(
    M: int = 131072, d: int = 2048, f: int = 5632, log: Callable[[str], None] = print, device: str = "cuda", extras: bool = False
) -> list[dict]:
    """Design variants at one shape: the pack pass (scan; bits: rows per
    program, columns per step, warps; one tile per row vs 256-column tiles), the up/down
    kernels (one program per token with several step sizes and warps; token blocks on tensor
    cores), and the ceilings (device copy, cuBLAS bf16 rate).
    ``extras`` adds the skewed and heavy cases and the losing designs (row-block kernel,
    256-column tiles)."""
    from ..kernels import OverflowCounters, ffn_from_twell, gate_pack, pack_relu, updown
    from ..inference.ops import prepare_gated_weights

    info = machine_info()
    out = []

    def add(**kw):
        kw.update(info)
        out.append(kw)
        log("  ".join(f"{a}={b:.4g}" if isinstance(b, float) else f"{a}={b}" for a, b in kw.items() if a not in info))

    buf = torch.empty(2 * 1024**3 if device == "cuda" else 1024, dtype=torch.uint8, device=device)
    dst = torch.empty_like(buf)
    ms = bench_ms(lambda: dst.copy_(buf))
    add(variant="copy_2GiB", ms=ms, TBps=2 * buf.numel() / ms / 1e9)
    del buf, dst
    n = 8192 if device == "cuda" else 64
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    ms = bench_ms(lambda: a @ a)
    add(variant=f"mm_{n}_bf16", ms=ms, TFLOPs=2 * n**3 / ms / 1e9)
    del a

    row_tile = 8192 if f > 4096 else 1 << max(4, (f - 1).bit_length())
    bits_configs = [(2, 512, 1), (4, 256, 1), (8, 256, 2), (4, 256, 2), (2, 256, 1), (8, 256, 4)]
    token_configs = [(2, 4), (4, 4), (4, 8), (2, 2), (4, 2), (8, 4)]
    saved_bits, saved_tuned = gate_pack.PACK_BITS_CONFIG, dict(updown.TUNED)
    cases = [(29, "even"), (56, "even"), (8, "even")] + ([(29, "skewed"), (29, "heavy")] if extras else [])
    for k, dist in cases:
        s = make_ffn(M, d, f, k, dist, dtype=torch.bfloat16, device=device, seed=7)
        x, wg = s.x, s.w_gate
        w = prepare_gated_weights(s.w_up, s.w_down)
        add(variant="dense", k=k, dist=dist, ms=bench_ms(lambda: dense_gated(x, wg, s.w_up, s.w_down)))
        if k == 29 and dist == "even":
            add(variant="gate_cublas", k=k, dist=dist, ms=bench_ms(lambda: torch.mm(x, wg.T)))
        pre = torch.mm(x, wg.T)
        c = OverflowCounters.zeros(x.device)
        sweep = dist == "even" and k in (29, 56)
        cfg = gate_pack.PACK_CONFIG
        ms = bench_ms(lambda: pack_relu(pre, row_tile, 8, method="scan", config=cfg))
        add(variant="pack_scan", tile=row_tile, C=8, cfg="x".join(map(str, cfg)), k=k, dist=dist, ms=ms, GBps=pre.numel() * 2 / ms / 1e6)
        for cfg in bits_configs if sweep else [saved_bits]:
            ms = bench_ms(lambda: pack_relu(pre, row_tile, 8, method="bits", config=cfg))
            add(variant="pack_bits", tile=row_tile, C=8, cfg="x".join(map(str, cfg)), k=k, dist=dist, ms=ms, GBps=pre.numel() * 2 / ms / 1e6)
        g = pack_relu(pre, row_tile, 8)
        pairs = float(g.counts.clamp(max=g.slots).sum())
        for be, nw in token_configs if sweep else [saved_tuned.get(2048, (8, 4))]:
            ms = bench_ms(lambda: ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre, counters=c, kernel="token", block_e=be, num_warps=nw))
            add(variant="updown_token", tile=row_tile, C=8, cfg=f"{be}x{nw}", k=k, dist=dist, ms=ms, pairs=pairs,
                overflow_rows=int((g.counts > g.slots).sum()), pair_GBps=pairs * 4 * d / ms / 1e6)
        if k == 29 and dist == "even" and extras:
            updown.ROWS_CONFIG = (16, 32, 128, 4)
            ms = bench_ms(lambda: ffn_from_twell(x, g, w.down_t, w_up=w.up, pre=pre, counters=c, kernel="rows"))
            add(variant="updown_rows", tile=row_tile, C=8, cfg="16x32x128x4", k=k, dist=dist, ms=ms, pair_GBps=pairs * 4 * d / ms / 1e6)
            g256 = pack_relu(pre, 256, 4)
            add(variant="pack_bits", tile=256, C=4, cfg="x".join(map(str, saved_bits)), k=k, dist=dist, ms=bench_ms(lambda: pack_relu(pre, 256, 4)))
            ms = bench_ms(lambda: ffn_from_twell(x, g256, w.down_t, w_up=w.up, pre=pre, counters=c, kernel="token"))
            add(variant="updown_token", tile=256, C=4, cfg="8x4", k=k, dist=dist, ms=ms, pair_GBps=pairs * 4 * d / ms / 1e6)
            del g256
        del g, pre, s, x, wg, w
        torch.cuda.empty_cache()
    return out


def best_config(variants: list[dict], variant: str, ks=(29, 56)) -> Optional[tuple[int, ...]]:
    """Configuration of ``variant`` with the least total time over the swept even cases of ``ks``."""
    total: dict = {}
    for v in variants:
        if v.get("variant") == variant and v.get("dist") == "even" and v.get("k") in ks and "ms" in v and v.get("C") == 8:
            total[v["cfg"]] = total.get(v["cfg"], 0.0) + v["ms"]
    if not total:
        return None
    return tuple(int(t) for t in min(total, key=total.get).split("x"))


def break_even_density(variants: list[dict], f: int = 5632) -> Optional[float]:
    """Density (active units / f) below which the kernels beat dense with a 10% margin, from
    the even cases: kernel time = cuBLAS gate + best pack + best up/down, interpolated
    linearly in k between the measured points."""
    dense = [v["ms"] for v in variants if v.get("variant") == "dense" and v.get("dist") == "even"]
    gate = [v["ms"] for v in variants if v.get("variant") == "gate_cublas"]
    pts: dict = {}
    for v in variants:
        if v.get("dist") != "even" or "ms" not in v or v.get("C") != 8:
            continue
        if v.get("variant") in ("pack_bits", "updown_token"):
            p = pts.setdefault(v["k"], {})
            p[v["variant"]] = min(p.get(v["variant"], 1e9), v["ms"])
    ks = sorted(k for k, p in pts.items() if len(p) == 2)
    if not dense or not gate or len(ks) < 2:
        return None
    target = 0.9 * sum(dense) / len(dense)
    t = [gate[0] + pts[k]["pack_bits"] + pts[k]["updown_token"] for k in ks]
    for (k0, t0), (k1, t1) in zip(zip(ks, t), zip(ks[1:], t[1:])):
        if t1 >= target:
            if t0 >= target:
                return k0 * (target / t0) / f if t0 > 0 else 0.0
            return (k0 + (k1 - k0) * (target - t0) / (t1 - t0)) / f
    k0, k1, t0, t1 = ks[-2], ks[-1], t[-2], t[-1]
    slope = (t1 - t0) / (k1 - k0)
    return (k1 + (target - t1) / slope) / f if slope > 0 else None


