"""Launch shapes of the split decode kernels, timed as a model runs them (issue 9).

    OUT=DIR python benchmarks/split_chain_probe.py

The split kernels' shapes (``twell.kernels.decode_split.SPLIT_CONFIG``) were chosen with L2
zeroed before each replay (benchmarks/NOTES_decode.md, tenth session). Timed instead in a chain
of LAYERS layers with their own weights in one CUDA graph (``twell.bench.timing.chain_graph_ms``,
as ``twell bench decode`` times them), other shapes may win. For each shape, k in {8, 29, 56} even and M in {4, 8, 16, 32,
64}: the module with its decode kernels forced, microseconds per layer; dense beside it. Writes
OUT/split_chain_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os

import torch

import twell.kernels.decode_split as split
from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import chain_graph_ms

LAYERS = 8

OUT = os.environ.get("OUT", "/tmp")
C = split.SplitConfig
# name: (config, GATE_DESC_MIN_ROWS)
SHAPES = {
    "shipped": (None, split.GATE_DESC_MIN_ROWS),  # None: SPLIT_CONFIG, SPLIT_DESC_CONFIG as shipped
    # thirteenth session: the gate's loads through tensor descriptors (shipped) or pointers (before)
    "pointer gate": (split.SPLIT_CONFIG, 1 << 30),
    "desc s4": (C(64, 128, 4, 4, 1056, 4096, 8), 16),
    "desc w8": (C(64, 128, 8, 6, 1056, 4096, 8), 16),
    "desc BK64 s8": (C(64, 64, 4, 8, 1056, 4096, 8), 16),
    "desc BU128 s4": (C(128, 128, 4, 4, 1056, 4096, 8), 16),
    # fourteenth session: 32-unit gate programs with descriptors (tokens as the dot's rows, so
    # the wgmma tile is 64 x 32): 176 programs, more SMs streaming the gate
    "desc BU32 s6": (C(32, 128, 4, 6, 1056, 4096, 8), 64),
    "desc BU32 s4": (C(32, 128, 4, 4, 1056, 4096, 8), 64),
    "desc BU32 BK256 s3": (C(32, 256, 4, 3, 1056, 4096, 8), 64),
    "desc BU32 w8 s6": (C(32, 128, 8, 6, 1056, 4096, 8), 64),
    "desc32 BU32 s6": (C(32, 128, 4, 6, 1056, 4096, 8), 32),
    "desc BU32 s3": (C(32, 128, 4, 3, 1056, 4096, 8), 64),
    "desc BU32 s2": (C(32, 128, 4, 2, 1056, 4096, 8), 64),
    "desc BU32 BK64 s6": (C(32, 64, 4, 6, 1056, 4096, 8), 64),
    "desc BU32 BK64 s4": (C(32, 64, 4, 4, 1056, 4096, 8), 64),
    "desc BU16 s4": (C(16, 128, 4, 4, 1056, 4096, 8), 64),
    "desc BU64 s3": (C(64, 128, 4, 3, 1056, 4096, 8), 64),
    # twentieth session: a split-K gate (SplitConfig.splitk) was timed here and lost everywhere;
    # its kernel and shapes are in commit 9c176f6 (benchmarks/NOTES_decode.md)
}
# SHAPES=name,name... and MS=m,m... (environment) run a subset
if os.environ.get("SHAPES"):
    SHAPES = {n: SHAPES[n] for n in os.environ["SHAPES"].split(",")}
MS = tuple(int(m) for m in os.environ.get("MS", "4,8,16,32,64").split(","))


def main() -> None:
    records = []
    shipped = split.SPLIT_CONFIG, split.SPLIT_DESC_CONFIG, split.GATE_DESC_MIN_ROWS
    for k in (8, 29, 56):
        s = make_ffn(4096, 2048, 5632, k, "even", dtype=torch.bfloat16, device="cuda", seed=k + 23)
        pairs = [_pair(s) for _ in range(LAYERS)]
        dense = [p[0] for p in pairs]
        twell = [p[1] for p in pairs]
        for M in MS:
            x = s.x[:M].contiguous()
            rec = dict(M=M, k=k, layers=LAYERS)
            with torch.no_grad():
                for t in twell:
                    _warm(t, x)
                    t.kernel_mode = "decode"
                rec["dense_us"] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in dense])
                ref = dense[0](x).float()
                for name, (cfg, min_rows) in SHAPES.items():
                    if cfg is not None:
                        split.SPLIT_CONFIG = split.SPLIT_DESC_CONFIG = cfg
                    split.GATE_DESC_MIN_ROWS = min_rows
                    try:
                        rec[name] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in twell])
                        err = float((twell[0](x).float() - ref).norm() / ref.norm())
                        rec[name + " err"] = err
                        rec[name + " kernels"] = twell[0]._twell_layer.last_decode_kernels
                    except Exception as e:  # noqa: BLE001 - a shape that does not compile: keep going
                        rec[name] = None
                        rec[name + " error"] = repr(e)[:200]
                    finally:
                        split.SPLIT_CONFIG, split.SPLIT_DESC_CONFIG, split.GATE_DESC_MIN_ROWS = shipped
                for t in twell:
                    t.kernel_mode = "auto"
            records.append(rec)
            best = min((n for n in SHAPES if rec[n] is not None), key=lambda n: rec[n])
            row = " ".join(f"{rec[n]:5.1f}" if rec[n] is not None else "  -  " for n in SHAPES)
            print(f"k {k:2d} M {M:2d} dense {rec['dense_us']:5.1f} | {row} | best {best} x{rec['dense_us'] / rec[best]:.2f} "
                  f"(shipped x{rec['dense_us'] / rec[next(iter(SHAPES))]:.2f})", flush=True)
        del s, pairs, dense, twell
        torch.cuda.empty_cache()
    print("columns:", " | ".join(SHAPES))
    with open(os.path.join(OUT, "split_chain_probe.json"), "w") as fh:
        json.dump({"meta": dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, layers=LAYERS,
                                shapes={n: dict(c._asdict() if c else dict(pointer=split.SPLIT_CONFIG._asdict(), desc=split.SPLIT_DESC_CONFIG._asdict()),
                                                 desc_min_rows=r) for n, (c, r) in SHAPES.items()}), "records": records}, fh, indent=1)


if __name__ == "__main__":
    main()
