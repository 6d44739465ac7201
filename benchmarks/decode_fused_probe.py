"""Issue 9: does the fused decode kernel (twell.kernels.decode_fused: one weight-reading kernel,
then the write-out) beat the three-launch decode path and dense? One device call.

For M in (1, 4, 16) and k in (8, 29, 56) spread evenly (d 2048, f 5632, bf16), every call
captured in a CUDA graph and its replays timed (L2 flushed before each): dense PyTorch, the
shipped decode path (twell.kernels.ffn_decode), and the fused kernel over a few block shapes.
Each fused shape is first checked five times against fp32 (a varying or wrong sum means the
adds are not ordered before the cast). Records errors and the bytes each must read.

    python benchmarks/decode_fused_probe.py [OUTDIR]
    python benchmarks/decode_fused_probe.py [OUTDIR] --sweep   # k 29 only: more block shapes, the
        # fixed costs (cuBLAS gate, memset + cast), and a kept accumulator against a fresh one
    TRITON_INTERPRET=1 python benchmarks/decode_fused_probe.py /tmp --smoke   # CPU, tiny, untimed

Writes OUTDIR/decode_fused_probe.json; prints a table. A failing shape is recorded, not fatal.
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from twell.bench.inference import dense_gated, errors, reference_fp32
from twell.bench.synthetic import make_ffn
from twell.kernels.decode import ffn_decode
from twell.kernels.decode_fused import ffn_decode_fused

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
SMOKE = "--smoke" in sys.argv
D, F = (64, 320) if SMOKE else (2048, 5632)
DEVICE = "cpu" if SMOKE else "cuda"
# the CPU interpreter computes bf16 tl.dot wrongly, so the smoke run uses fp16
DTYPE = torch.float16 if SMOKE else torch.bfloat16
# (BU, BK, BD, num_warps, num_stages); adds over all 16 buffer rows, measured in the first run
# (decode_fused_probe_2026-12-01_s4.json, "_allrows"), were slower and were dropped
CONFIGS = [(32, 256, 256, 4, 3), (16, 256, 256, 4, 3), (16, 512, 256, 4, 2), (32, 128, 256, 4, 4),
           (64, 256, 256, 8, 3), (32, 512, 256, 8, 2), (16, 128, 512, 4, 4)]
# --sweep: more shapes at k = 29 only (which occupancy and how many loads in flight the gate needs)
SWEEP = "--sweep" in sys.argv
if SWEEP:
    CONFIGS = [(16, 256, 256, 4, 3), (64, 256, 256, 8, 3), (16, 128, 256, 4, 2),
               (16, 128, 256, 2, 3), (16, 64, 256, 2, 4), (16, 128, 128, 4, 4),
               (16, 256, 256, 8, 2), (16, 256, 256, 2, 2), (32, 128, 256, 4, 2),
               (32, 128, 128, 8, 3), (64, 128, 256, 8, 2), (64, 64, 256, 4, 4)]
if SMOKE:
    CONFIGS = [(16, 32, 32, 4, 1)]


def graph_us(fn) -> float:
    if SMOKE:
        fn()
        return 0.0
    from twell.bench.timing import graph_ms

    return 1e3 * graph_ms(fn)


def main() -> None:
    rows = []
    if SWEEP and not SMOKE:  # the fixed parts: the gate alone in cuBLAS, the memset and the cast
        s = make_ffn(16, D, F, 29, "even", dtype=DTYPE, device=DEVICE, seed=3)
        x1 = s.x[:1].contiguous()
        rows.append(dict(what="fixed", cublas_gate_us=graph_us(lambda: torch.mm(x1, s.w_gate.T)),
                         memset_cast_us=graph_us(lambda: torch.zeros(1, D, device=DEVICE).to(DTYPE))))
        print(rows[-1], flush=True)
        from twell.kernels.decode_fused import DecodeScratch
        from twell.bench.timing import alternating, graph_ms

        wdt = s.w_down.T.contiguous()
        scratch = DecodeScratch(D, DEVICE)
        for M in (1, 4, 16):
            x = s.x[:M].contiguous()
            fresh, kept = alternating(graph_ms, [lambda: ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up),
                                                 lambda: ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, scratch=scratch)])
            rows.append(dict(what="scratch", M=M, fresh_us=1e3 * fresh, scratch_us=1e3 * kept,
                             scratch_clean=bool(torch.all(scratch.acc == 0))))
            print(rows[-1], flush=True)
    for k in ((29,) if SWEEP else (8, 29, 56)):
        s = make_ffn(64, D, F, k, "even", dtype=DTYPE, device=DEVICE, seed=k + 5)
        wdt = s.w_down.T.contiguous()
        for M in (1, 4, 16):
            x = s.x[:M].contiguous()
            ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
            union = int(((x.float() @ s.w_gate.float().T) > 0).any(0).sum())
            rec = dict(M=M, k=k, union=union, need_MB=(F * D + 2 * union * D) * 2 / 1e6)
            rec["dense_us"] = graph_us(lambda: dense_gated(x, s.w_gate, s.w_up, s.w_down))
            rec["decode_us"] = graph_us(lambda: ffn_decode(x, s.w_gate, wdt, w_up=s.w_up))
            rec["dense_rel_err"], rec["dense_row_err"] = errors(dense_gated(x, s.w_gate, s.w_up, s.w_down), ref)
            for cfg in CONFIGS:
                name = "x".join(map(str, cfg))
                try:
                    errs = [errors(ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, config=cfg), ref) for _ in range(5)]
                    rel, row = max(e[0] for e in errs), max(e[1] for e in errs)
                    us = graph_us(lambda: ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, config=cfg))
                    # the captured graph's output, replayed, against fp32 too
                    rec[f"fused_{name}"] = dict(us=us, rel_err=rel, row_err=row, ok=bool(rel < 1e-2 and row <= 2 * rec["dense_row_err"] + 1e-6))
                except Exception as e:  # noqa: BLE001 - a probe records every failure and goes on
                    rec[f"fused_{name}"] = dict(error=repr(e)[:300], trace=traceback.format_exc()[-600:])
            rows.append(rec)
            with open(os.path.join(OUT, "decode_fused_probe.json"), "w") as fh:  # after every record: a cut run keeps it
                json.dump(rows, fh, indent=1)
            fused = {n: v for n, v in rec.items() if n.startswith("fused_") and "us" in v and v["ok"]}
            bad = [n[6:] for n, v in rec.items() if n.startswith("fused_") and not v.get("ok", False)]
            best = min(fused.items(), key=lambda t: t[1]["us"]) if fused else None
            print(f"M {M:2d} k {k:2d} union {union:5d}: dense {rec['dense_us']:6.1f} us, decode {rec['decode_us']:6.1f} "
                  f"(x{rec['dense_us'] / max(rec['decode_us'], 1e-9):.2f}), "
                  + (f"fused best {best[1]['us']:6.1f} ({best[0][6:]}, err {best[1]['rel_err']:.1e}, "
                     f"x{rec['dense_us'] / max(best[1]['us'], 1e-9):.2f} dense)" if best else "fused: none exact")
                  + (f"; NOT EXACT or failed: {bad}" if bad else ""), flush=True)
    if not SMOKE:
        print("\nall fused shapes (us):")
        try:  # shared memory and registers of each compiled shape (occupancy), best effort
            from twell.kernels.decode_fused import _decode_fused_kernel as kern

            for dev_cache in kern.device_caches.values():
                for ck in dev_cache[0].values():
                    md = ck.metadata
                    print(f"  compiled: warps {md.num_warps} stages {md.num_stages} shared {md.shared} B regs {ck.n_regs} spills {ck.n_spills}")
        except Exception as e:  # noqa: BLE001
            print("  (no compiled-kernel metadata:", repr(e)[:120], ")")
        recs = [r for r in rows if "M" in r and "what" not in r]
        names = [n for n in recs[0] if n.startswith("fused_")]
        for n in names:
            print(f"  {n[6:]:24s} " + " ".join(f"{r[n].get('us', float('nan')):6.1f}" for r in recs))


if __name__ == "__main__":
    main()
