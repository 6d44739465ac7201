"""Issue 9: does the CUDA-core variant of the fused decode kernel (``_decode_gemv_kernel``: each
program loads its few units' whole gate rows at once) beat the tensor-core one at a few tokens?
One device call.

For M in (1, 2, 4, 8) and k in (8, 29, 56) even plus k 29 skewed (d 2048, f 5632, bf16), every
call captured in a CUDA graph and its replays timed (L2 flushed before each), both kernels with
a kept accumulator (``DecodeScratch``) as the dispatcher runs them: dense PyTorch, the
tensor-core kernel at its shipped shape, and the CUDA-core kernel over a sweep of shapes. Each
shape is first checked five times against fp32 and dense's worst row.

    python benchmarks/decode_gemv_probe.py [OUTDIR]
    python benchmarks/decode_gemv_probe.py [OUTDIR] --pdl   # the shipped shapes only, M 1 to 8, each
        # kernel with its write-out as a programmatic dependent launch and without (alternating
        # rounds), plus a few one-warp shapes at M = 1
    python benchmarks/decode_gemv_probe.py [OUTDIR] --dot   # the tensor-core kernel's shapes at
        # M 6, 8 and 16 (after its adds were limited to rows with an active unit in the block)
    python benchmarks/decode_gemv_probe.py [OUTDIR] --wide  # the same on 32- and 64-row tiles at
        # M 24 to 64, against the three-launch path
    TRITON_INTERPRET=1 python benchmarks/decode_gemv_probe.py /tmp --smoke   # CPU, tiny, untimed

Writes OUTDIR/decode_gemv_probe.json; prints a table (us, and the speedup over dense of the best).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch

from twell.bench.inference import dense_gated, errors, reference_fp32
from twell.bench.synthetic import make_ffn
from twell.kernels.decode_fused import FUSED_CONFIG, GEMV_CONFIGS, DecodeScratch, GemvConfig, ffn_decode_fused

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
SMOKE = "--smoke" in sys.argv
D, F = (64, 320) if SMOKE else (2048, 5632)
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float16 if SMOKE else torch.bfloat16
# (BU, BK, warps, stages): how many units per program, whole rows or halves, occupancy
GEMV = [GemvConfig(2, 2048, 2, 1), GemvConfig(4, 2048, 2, 1), GemvConfig(4, 2048, 4, 1), GemvConfig(8, 2048, 4, 1),
        GemvConfig(8, 2048, 8, 1), GemvConfig(16, 2048, 8, 1), GemvConfig(4, 1024, 4, 1), GemvConfig(8, 1024, 4, 1),
        GemvConfig(4, 1024, 4, 2), GemvConfig(4, 512, 4, 3)]
if SMOKE:
    GEMV = [GemvConfig(4, 32, 4, 1)]
CASES = [(8, "even"), (29, "even"), (56, "even"), (29, "skewed")]
# the tensor-core kernel's shape at 1 and 2 tokens before the CUDA-core variant took them over
DOT_SMALL = (16, 256, 256, 4, 3)
MS = (1, 2, 4, 8)
SWEEP = [("gemv_" + "x".join(map(str, c)), c) for c in GEMV]
if "--dot" in sys.argv:  # (BU, BK, BD, warps, stages)
    MS = (6, 8, 16)
    SWEEP = [("dot_" + "x".join(map(str, c)), c) for c in [(16, 256, 256, 4, 3), (32, 256, 256, 4, 3), (32, 256, 256, 8, 3),
                                                           (64, 256, 256, 8, 3), (16, 512, 256, 4, 2), (32, 128, 256, 4, 4),
                                                           (16, 256, 512, 4, 3), (32, 512, 512, 8, 2)]]
    if SMOKE:
        SWEEP = [("dot_16x32x32x4x1", (16, 32, 32, 4, 1))]
if "--wide" in sys.argv:  # the tensor-core kernel on 32- and 64-row tiles, against the three-launch path
    MS = (24, 32, 48, 64)
    SWEEP = [("dot_" + "x".join(map(str, c)), c) for c in [(64, 256, 256, 8, 3), (32, 256, 256, 4, 3), (64, 128, 256, 8, 3),
                                                           (32, 128, 256, 4, 3), (64, 256, 128, 8, 2), (128, 128, 128, 8, 3),
                                                           (16, 256, 256, 4, 3)]]
    if SMOKE:
        SWEEP = [("dot_16x32x32x4x1", (16, 32, 32, 4, 1))]


def graph_us(fn) -> float:
    if SMOKE:
        fn()
        return 0.0
    from twell.bench.timing import graph_ms

    return 1e3 * graph_ms(fn)


def pdl_main() -> None:
    if SMOKE:
        raise SystemExit("--pdl times CUDA graphs: it needs a GPU")
    from twell.bench.timing import alternating, graph_ms
    from twell.kernels import _launch
    from twell.kernels.decode_fused import fused_config

    def with_pdl(on, fn):
        def run():
            _launch.USE_PDL = on
            try:
                return fn()
            finally:
                _launch.USE_PDL = True
        return run

    rows = []
    scratch = DecodeScratch(D, DEVICE)
    for k, dist in [(29, "even"), (56, "even")]:
        s = make_ffn(64, D, F, k, dist, dtype=DTYPE, device=DEVICE, seed=k + 7)
        wdt = s.w_down.T.contiguous()
        for M in (1, 2, 3, 4, 5, 6, 8):
            x = s.x[:M].contiguous()
            ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
            rec = dict(M=M, k=k, distribution=dist)
            _, rec["dense_row_err"] = errors(dense_gated(x, s.w_gate, s.w_up, s.w_down), ref)
            dot = DOT_SMALL if M <= 2 else FUSED_CONFIG
            cands = [("dot", dot), ("gemv", fused_config(M) if M <= max(GEMV_CONFIGS) else GEMV_CONFIGS[max(GEMV_CONFIGS)])]
            if M == 1:
                cands += [("gemv_1x2048x1x1", GemvConfig(1, 2048, 1, 1)), ("gemv_2x2048x1x1", GemvConfig(2, 2048, 1, 1)),
                          ("gemv_1x2048x2x1", GemvConfig(1, 2048, 2, 1))]
            fns = [lambda: dense_gated(x, s.w_gate, s.w_up, s.w_down)]
            names = ["dense"]
            for name, cfg in cands:
                for on in (False, True):
                    fn = with_pdl(on, lambda cfg=cfg: ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, config=cfg, scratch=scratch))
                    errs = [errors(fn(), ref) for _ in range(5)]
                    rec[f"{name}_pdl{int(on)}_ok"] = bool(max(e[0] for e in errs) < 1e-2 and max(e[1] for e in errs) <= 2 * rec["dense_row_err"] + 1e-6
                                                          and torch.all(scratch.acc == 0))
                    fns.append(fn)
                    names.append(f"{name}_pdl{int(on)}")
            times = alternating(graph_ms, fns)
            rec.update({f"{n}_us": 1e3 * t for n, t in zip(names, times)})
            rows.append(rec)
            with open(os.path.join(OUT, "decode_gemv_pdl.json"), "w") as fh:
                json.dump(rows, fh, indent=1)
            bad = [n for n in rec if n.endswith("_ok") and not rec[n]]
            print(f"M {M} k {k:2d}: " + ", ".join(f"{n} {rec[n + '_us']:5.1f}" for n in names)
                  + (f"; NOT EXACT: {bad}" if bad else ""), flush=True)


def main() -> None:
    if "--pdl" in sys.argv:
        return pdl_main()
    rows = []
    scratch = DecodeScratch(D, DEVICE)
    for k, dist in CASES:
        s = make_ffn(64, D, F, k, dist, dtype=DTYPE, device=DEVICE, seed=k + 7)
        wdt = s.w_down.T.contiguous()
        for M in MS:
            x = s.x[:M].contiguous()
            ref = reference_fp32(x, s.w_gate, s.w_up, s.w_down)
            union = int(((x.float() @ s.w_gate.float().T) > 0).any(0).sum())
            rec = dict(M=M, k=k, distribution=dist, union=union, need_MB=(F * D + 2 * union * D) * 2 / 1e6)
            rec["dense_us"] = graph_us(lambda: dense_gated(x, s.w_gate, s.w_up, s.w_down))
            rec["dense_rel_err"], rec["dense_row_err"] = errors(dense_gated(x, s.w_gate, s.w_up, s.w_down), ref)
            if M > 16:
                from twell.kernels.decode import ffn_decode

                rec["three_launch_us"] = graph_us(lambda: ffn_decode(x, s.w_gate, wdt, w_up=s.w_up))
            dot = DOT_SMALL if M <= 2 else FUSED_CONFIG
            for name, cfg in [("dot", dot)] + SWEEP:
                try:
                    errs = [errors(ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, config=cfg, scratch=scratch), ref) for _ in range(5)]
                    rel, row = max(e[0] for e in errs), max(e[1] for e in errs)
                    us = graph_us(lambda: ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, config=cfg, scratch=scratch))
                    ok = bool(rel < 1e-2 and row <= 2 * rec["dense_row_err"] + 1e-6 and torch.all(scratch.acc == 0))
                    rec[name] = dict(us=us, rel_err=rel, row_err=row, ok=ok)
                except Exception as e:  # noqa: BLE001 - a probe records every failure and goes on
                    rec[name] = dict(error=repr(e)[:300], trace=traceback.format_exc()[-600:])
            rows.append(rec)
            with open(os.path.join(OUT, "decode_gemv_probe.json"), "w") as fh:  # after every record
                json.dump(rows, fh, indent=1)
            gemv = {n: v for n, v in rec.items() if n in dict(SWEEP) and v.get("ok")}
            bad = [n for n, v in rec.items() if isinstance(v, dict) and not v.get("ok", False)]
            best = min(gemv.items(), key=lambda t: t[1]["us"]) if gemv else None
            d_us = rec["dot"].get("us", float("nan"))
            print(f"M {M} k {k:2d} {dist:6s} union {union:4d} (share {union / F:.3f}): dense {rec['dense_us']:5.1f} us, "
                  + (f"three launches {rec['three_launch_us']:5.1f}, " if "three_launch_us" in rec else "") + f"dot {d_us:5.1f} "
                  f"(x{rec['dense_us'] / max(d_us, 1e-9):.2f}), "
                  + (f"best {best[1]['us']:5.1f} ({best[0]}, x{rec['dense_us'] / max(best[1]['us'], 1e-9):.2f})" if best else "none exact")
                  + (f"; NOT EXACT or failed: {bad}" if bad else ""), flush=True)
    if not SMOKE:
        print("\nevery shape (us), columns: " + " | ".join(f"M{r['M']} k{r['k']}{r['distribution'][0]}" for r in rows))
        for n in [n for n in rows[0] if isinstance(rows[0][n], dict)]:
            print(f"  {n:22s} " + " ".join(f"{r[n].get('us', float('nan')):5.1f}" for r in rows))


if __name__ == "__main__":
    main()
