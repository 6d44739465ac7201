"""Runtime probe on a GPU (issues 8 and 9; run 2's version, with the Launcher experiment that lost
taken out): host costs, decode kernel block shapes,
dense with the kernel layout of w_down, and the module at every batch size, eager and in graphs.

    python benchmarks/runtime_probe.py OUTDIR

Writes OUTDIR/probe.json (everything) and prints a short table per section. Each section runs
on its own: one failing does not stop the others. d 2048, f 5632, bf16, units spread evenly.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import torch
import triton
import triton.language as tl

from twell import SparseGatedMLP
from twell.bench.inference import dense_gated, errors, machine_info, reference_fp32
from twell.bench.synthetic import make_ffn
from twell.bench.timing import eager_ms, graph_ms, host_us, peak_bytes
from twell.kernels import decode as D

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
R: dict = {"info": machine_info()}
d, f = 2048, 5632


def save():
    with open(os.path.join(OUT, "probe.json"), "w") as fh:
        json.dump(R, fh, indent=1)


def section(fn):
    t0 = time.time()
    print(f"== {fn.__name__}", flush=True)
    try:
        fn()
    except Exception:
        traceback.print_exc()
        R.setdefault("errors", []).append(fn.__name__ + ": " + traceback.format_exc()[-2000:])
    print(f"   ({time.time() - t0:.0f} s)", flush=True)
    save()


@triton.jit
def _nop(x_ptr, n, B: tl.constexpr):
    offs = tl.arange(0, B)
    tl.store(x_ptr + offs, offs.to(tl.float32), mask=offs < n)


def case(M, k, seed=0, dist="even"):
    s = make_ffn(4096, d, f, k, dist, dtype=torch.bfloat16, device="cuda", seed=seed)
    return s.x[:M].contiguous(), s.w_gate, s.w_up, s.w_down


def module_of(wg, wu, wd):
    m = SparseGatedMLP(d, f, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        m.gate_proj.weight.copy_(wg)
        m.up_proj.weight.copy_(wu)
        m.down_proj.weight.copy_(wd)
    return m.eval()


def host():
    out = {}
    buf = torch.zeros(16, device="cuda")
    out["triton_nop"] = host_us(lambda: _nop[(1,)](buf, 16, B=16))
    out["torch_empty"] = host_us(lambda: torch.empty(16, device="cuda"))
    out["torch_zeros"] = host_us(lambda: torch.zeros(16, device="cuda"))
    out["is_capturing"] = host_us(lambda: torch.cuda.is_current_stream_capturing())

    def device_ctx():
        with torch.cuda.device(buf.device):
            pass

    out["device_ctx"] = host_us(device_ctx)
    x, wg, wu, wd = case(1, 29)
    out["mm_M1"] = host_us(lambda: torch.mm(x, wg.t()))
    out["dense_mlp_M1"] = host_us(lambda: dense_gated(x, wg, wu, wd))
    m = module_of(wg, wu, wd)
    with torch.no_grad():
        out["module_auto_M1"] = host_us(lambda: m(x))
        out["module_auto_M1_path"] = m.last_path
        m.kernel_mode = "dense"
        out["module_dense_M1"] = host_us(lambda: m(x))
        m.kernel_mode = "auto"
        wdt = m.down_proj.weight.t()
        out["decode_launch_M1"] = host_us(lambda: D.decode_launch(x, wg, wdt, wu))
        out["layer_run_M1"] = host_us(lambda: m._twell_layer.run(x, m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight))
        from twell import library  # noqa: F401

        args = (x, m.gate_proj.weight, m.down_proj.weight, m.up_proj.weight, m._twell_key)
        out["custom_op_M1"] = host_us(lambda: torch.ops.twell.ffn_infer(*args))
    R["host_us"] = out
    for k_, v in out.items():
        print(f"   {k_:24s} {v if isinstance(v, str) else f'{v:8.1f} us'}")


def _stages(x, wg, wu, wdt, cfg):
    """(up kernel alone, down (+ sum) alone) callables with preallocated scratch (gate done once)."""
    M = x.shape[0]
    BM, BU, BK, nw1, BD, BE, nw2, S = cfg
    NB, NC = triton.cdiv(f, BU), triton.cdiv(M, BM)
    pre = torch.mm(x, wg.t())
    h = torch.empty(NC * NB * BU * BM, dtype=x.dtype, device="cuda")
    units = torch.empty(NC * NB * BU, dtype=torch.int32, device="cuda")
    counts = torch.empty(NC * NB, dtype=torch.int32, device="cuda")
    part = torch.empty(max(1, S) * M * d, dtype=torch.float32, device="cuda")
    out = torch.empty(M, d, dtype=x.dtype, device="cuda")

    def up():
        D._decode_up_kernel[(NB, NC)](pre, pre.stride(0), x, x.stride(0), wu, wu.stride(0), h, units, counts, counts, counts,
                                      M, d, f, NB, BM=BM, BU=BU, BK=BK, GATED=True, TRACK=False, PREC="tf32", num_warps=nw1)

    def down():
        D._decode_down_kernel[(triton.cdiv(d, BD), S, NC)](h, units, counts, wdt, wdt.stride(0), out, out.stride(0), part, M, d, NB,
                                                           BM=BM, BU=BU, BD=BD, BE=BE, NBP=max(16, triton.next_power_of_2(NB)),
                                                           SPLITS=S, PREC="tf32", num_warps=nw2)
        if S > 1:
            D._decode_sum_kernel[(triton.cdiv(M * d, 1024),)](part, out, out.stride(0), M, d, SPLITS=S, BLOCK=1024, num_warps=4)

    up()
    torch.cuda.synchronize()
    return up, down


def decode_sweep():
    rows = []
    up_cfgs = [(16, 512, 4), (32, 512, 4), (64, 512, 4), (32, 256, 4), (32, 1024, 4), (32, 512, 8), (64, 256, 8), (16, 1024, 2)]
    down_cfgs = [(16, 32, 4, 1), (32, 32, 4, 1), (16, 64, 4, 1), (32, 64, 4, 2), (32, 64, 4, 4), (32, 64, 4, 8),
                 (64, 64, 4, 8), (32, 128, 4, 8), (16, 64, 2, 4), (32, 32, 4, 4)]
    for M in (1, 4, 16, 64):
        BM = max(16, min(64, triton.next_power_of_2(M)))
        for k in (29, 280):
            x, wg, wu, wd = case(M, k, seed=M)
            wdt = wd.T.contiguous()
            rec = dict(M=M, k=k, dense_graph_us=1e3 * graph_ms(lambda: dense_gated(x, wg, wu, wd)),
                       gate_graph_us=1e3 * graph_ms(lambda: torch.mm(x, wg.t())))
            for BU, BK, nw1 in up_cfgs:
                up, _ = _stages(x, wg, wu, wdt, (BM, BU, BK, nw1, 32, 32, 4, 1))
                rec[f"up_{BU}x{BK}x{nw1}_us"] = 1e3 * graph_ms(up)
            for BU in (16, 32, 64):
                for BD, BE, nw2, S in down_cfgs:
                    _, dn = _stages(x, wg, wu, wdt, (BM, BU, 512, 4, BD, BE, nw2, S))
                    rec[f"down{BU}_{BD}x{BE}x{nw2}x{S}_us"] = 1e3 * graph_ms(dn)
            cfg = D.decode_config(M)
            rec["config"] = cfg
            rec["decode_graph_us"] = 1e3 * graph_ms(lambda: D.decode_launch(x, wg, wdt, wu))
            ref = reference_fp32(x, wg, wu, wd)
            rec["rel_err"], rec["max_row_err"] = errors(D.decode_launch(x, wg, wdt, wu), ref)
            rec["dense_rel_err"], rec["dense_max_row_err"] = errors(dense_gated(x, wg, wu, wd), ref)
            rec["union"] = int(((x.float() @ wg.float().T) > 0).any(dim=0).sum())
            best_up = min((v, kk) for kk, v in rec.items() if kk.startswith("up_"))
            best = {}
            for BU in (16, 32, 64):
                best[BU] = min((v, kk) for kk, v in rec.items() if kk.startswith(f"down{BU}_"))
            rec["best_up"], rec["best_down"] = best_up[1], {b: v[1] for b, v in best.items()}
            rows.append(rec)
            print(f"   M={M:3d} k={k:4d} union={rec['union']:5d} dense {rec['dense_graph_us']:6.1f} gate {rec['gate_graph_us']:5.1f} "
                  f"decode {rec['decode_graph_us']:6.1f} us | up {best_up[1]} {best_up[0]:.1f} | down " +
                  " ".join(f"{b}:{v[1]} {v[0]:.1f}" for b, v in best.items()) +
                  f" | err {rec['rel_err']:.1e} row {rec['max_row_err']:.1e}/{rec['dense_max_row_err']:.1e}", flush=True)
            R["decode_sweep"] = rows
            save()


def decode_break_even():
    """Decode (default blocks) against dense over the share of units active in the batch."""
    rows = []
    for M in (1, 4, 16, 64):
        for k in (8, 29, 56, 120, 280, 560, 1000, 2000):
            x, wg, wu, wd = case(M, k, seed=M + k)
            wdt = wd.T.contiguous()
            rec = dict(M=M, k=k, union=int(((x.float() @ wg.float().T) > 0).any(dim=0).sum()),
                       dense_graph_us=1e3 * graph_ms(lambda: dense_gated(x, wg, wu, wd)),
                       decode_graph_us=1e3 * graph_ms(lambda: D.decode_launch(x, wg, wdt, wu)))
            rec["share"] = rec["union"] / f
            rows.append(rec)
            print(f"   M={M:3d} k={k:5d} share {rec['share']:.3f} dense {rec['dense_graph_us']:6.1f} decode {rec['decode_graph_us']:6.1f}"
                  f" x{rec['dense_graph_us'] / rec['decode_graph_us']:.2f}", flush=True)
    R["decode_break_even"] = rows


def module_grid():
    rows = []
    for k in (29, 280):
        for M in (1, 4, 16, 64, 256, 1024, 2048, 4096, 16384):
            x, wg, wu, wd = case(M, k, seed=7) if M <= 4096 else (None,) * 4
            if x is None:
                s = make_ffn(M, d, f, k, "even", dtype=torch.bfloat16, device="cuda", seed=7)
                x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
            m = module_of(wg, wu, wd)
            with torch.no_grad():
                for _ in range(3):
                    m(x)
                    torch.cuda.synchronize()
                rec = dict(M=M, k=k)
                rec["dense_ms"] = eager_ms(lambda: dense_gated(x, wg, wu, wd))
                rec["twell_ms"] = eager_ms(lambda: m(x))
                rec["path"] = m.last_path
                rec["dense_graph_ms"] = graph_ms(lambda: dense_gated(x, wg, wu, wd))
                rec["twell_graph_ms"] = graph_ms(lambda: m(x))
                rec["graph_path"] = m.last_path
                rec["host_us"] = host_us(lambda: m(x), calls=10) if M <= 4096 else None
                rec["dense_host_us"] = host_us(lambda: dense_gated(x, wg, wu, wd), calls=10) if M <= 4096 else None
                for mode in ("prefill", "decode") if M <= 4096 else ("prefill",):
                    if mode == "decode" and M > 1024:
                        continue
                    m.kernel_mode = mode
                    rec[f"{mode}_graph_ms"] = graph_ms(lambda: m(x))
                m.kernel_mode = "auto"
                ref = reference_fp32(x, wg, wu, wd)
                rec["rel_err"], rec["max_row_err"] = errors(m(x), ref)
                rec["dense_max_row_err"] = errors(dense_gated(x, wg, wu, wd), ref)[1]
                rec["peak_bytes"] = peak_bytes(lambda: m(x))
                rec["dense_peak_bytes"] = peak_bytes(lambda: dense_gated(x, wg, wu, wd))
            rec["speedup"] = rec["dense_ms"] / rec["twell_ms"]
            rec["graph_speedup"] = rec["dense_graph_ms"] / rec["twell_graph_ms"]
            rows.append(rec)
            R["module_grid"] = rows
            save()
            print(f"   k={k:3d} M={M:6d} eager {rec['dense_ms']:.4f}/{rec['twell_ms']:.4f} x{rec['speedup']:.2f} ({rec['path']}) "
                  f"graph {rec['dense_graph_ms']:.4f}/{rec['twell_graph_ms']:.4f} x{rec['graph_speedup']:.2f} "
                  f"pre {rec.get('prefill_graph_ms', 0):.4f} dec {rec.get('decode_graph_ms', 0):.4f} "
                  f"host {rec['host_us'] or 0:.0f}/{rec['dense_host_us'] or 0:.0f} err {rec['rel_err']:.1e} "
                  f"mem {rec['peak_bytes'] / 2**20:.0f}/{rec['dense_peak_bytes'] / 2**20:.0f} MiB", flush=True)
            del m, x, wg, wu, wd
            torch.cuda.empty_cache()


def compiled():
    import torch._dynamo

    rows = []
    for M in (4, 8192):
        s = make_ffn(max(M, 4096), d, f, 29, "even", dtype=torch.bfloat16, device="cuda", seed=3)
        mods = torch.nn.ModuleList(module_of(s.w_gate, s.w_up, s.w_down) for _ in range(2))
        x = s.x[:M]

        def model(x):
            for m in mods:
                x = x + m(x)
            return x

        with torch.no_grad():
            for _ in range(3):
                eager = model(x)
                torch.cuda.synchronize()
            t0 = time.time()
            cm = torch.compile(model, fullgraph=True)
            y = cm(x)
            torch.cuda.synchronize()
            rec = dict(M=M, compile_s=time.time() - t0, path=mods[0].last_path, rel=float((y.float() - eager.float()).norm() / eager.float().norm()))
            rec["eager_ms"] = eager_ms(lambda: model(x))
            rec["compiled_ms"] = eager_ms(lambda: cm(x))
            torch._dynamo.reset()
        rows.append(rec)
        print("   ", rec, flush=True)
    R["compiled"] = rows


if __name__ == "__main__":
    os.makedirs(OUT, exist_ok=True)
    for fn in (host, decode_sweep, decode_break_even, module_grid, compiled):
        section(fn)
