"""Issue 9: does the one-launch fused decode kernel (twell.kernels.decode_fused) beat the
three-launch decode path and dense? One device call.

For M in (1, 4, 16) and k in (8, 29, 56) spread evenly (d 2048, f 5632, bf16), every call
captured in a CUDA graph and its replays timed (L2 flushed before each): dense PyTorch, the
shipped decode path (twell.kernels.ffn_decode), and the fused kernel over a few block shapes.
Records errors against fp32 and the bytes each must read.

    python benchmarks/decode_fused_probe.py [OUTDIR]
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
from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
SMOKE = "--smoke" in sys.argv
D, F = (64, 320) if SMOKE else (2048, 5632)
DEVICE = "cpu" if SMOKE else "cuda"
# the CPU interpreter computes bf16 tl.dot wrongly (the shipped decode kernels too), so the smoke
# run uses fp16
DTYPE = torch.float16 if SMOKE else torch.bfloat16
# (BU, BK, BD, num_warps, num_stages)
CONFIGS = [(32, 256, 256, 4, 3), (16, 256, 256, 4, 3), (32, 128, 256, 4, 4), (64, 256, 256, 8, 3),
           (32, 512, 256, 8, 2), (16, 512, 512, 4, 2)]
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
    for k in (8, 29, 56):
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
                    scratch = DecodeScratch(D, x.device)
                    y = ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, scratch=scratch, config=cfg)
                    rel, row = errors(y, ref)
                    us = graph_us(lambda: ffn_decode_fused(x, s.w_gate, wdt, w_up=s.w_up, scratch=scratch, config=cfg))
                    clean = bool(torch.all(scratch.acc == 0)) and int(scratch.ticket) == 0
                    rec[f"fused_{name}"] = dict(us=us, rel_err=rel, row_err=row, scratch_clean=clean)
                except Exception as e:  # noqa: BLE001 - a probe records every failure and goes on
                    rec[f"fused_{name}"] = dict(error=repr(e)[:300], trace=traceback.format_exc()[-600:])
            rows.append(rec)
            with open(os.path.join(OUT, "decode_fused_probe.json"), "w") as fh:  # after every record: a cut run keeps it
                json.dump(rows, fh, indent=1)
            fused = {n: v for n, v in rec.items() if n.startswith("fused_") and "us" in v}
            best = min(fused.items(), key=lambda t: t[1]["us"]) if fused else None
            print(f"M {M:2d} k {k:2d} union {union:5d}: dense {rec['dense_us']:6.1f} us, decode {rec['decode_us']:6.1f}, "
                  + (f"fused best {best[1]['us']:6.1f} ({best[0][6:]}, err {best[1]['rel_err']:.1e}, "
                     f"x{rec['dense_us'] / max(best[1]['us'], 1e-9):.2f} dense)" if best else "fused: all failed"), flush=True)


if __name__ == "__main__":
    main()
