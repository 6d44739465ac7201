"""The weight gradients' schedule and the hot-unit limit on skewed layers, A/B in one process:
one layer's training call (the module with default settings, forward + backward, bf16, d 2048,
f 5632) timed in turn with dense PyTorch, under each setting of

- ``twell.train_ops.GRADS_LONGEST_FIRST``: the weight-gradient programs take the units longest
  first (else in unit order, where a long warm unit may start last and run alone). The first two
  runs of the fifty-fifth session ordered them by PyTorch's sort of the slot counts (74 us of
  GPU and 185 us of host per call, which ate the gain on fast layers); the third by the schedule
  ``heavy_and_hot`` writes, as shipped;
- the hot-unit limit: a unit with more than max(HOT_MIN, HOT_SHARE x M, HOT_FACTOR x the mean)
  slots gets its weight gradients from cuBLAS over a dense block (``twell.train_ops``; the first
  run of the fifty-fifth session varied HOT_FACTOR with no HOT_SHARE, 8 being the old default).

    python benchmarks/train_skewed_ab.py [OUTDIR]

Three rounds over the settings; writes OUTDIR/train_skewed_ab.json, prints one line per
measurement.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch

from twell import train_ops
from twell.bench.inference import machine_info
from twell.bench.synthetic import make_ffn
from twell.bench.timing import interleaved_ms
from twell.bench.training import _dense_fn, _module_fn

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
CASES = [(16384, 29, "skewed"), (16384, 8, "skewed"), (16384, 56, "skewed"), (16384, 8, "even"), (16384, 29, "even"),
         (16384, 29, "heavy"), (16384, 56, "heavy"), (65536, 29, "skewed")]
if os.environ.get("AB_CASES"):  # e.g. "16384:29:skewed,65536:29:even"
    CASES = [(int(M), float(k), dist) for M, k, dist in (c.split(":") for c in os.environ["AB_CASES"].split(","))]
# (name, longest first, HOT_SHARE, HOT_FACTOR)
SETTINGS = [("old: unit order, 8 x mean", False, 0.0, 8.0), ("unit order, 2% M, 2 x mean", False, 0.02, 2.0),
            ("new: schedule, 2% M, 2 x mean", True, 0.02, 2.0)]
if os.environ.get("AB_SETTINGS"):
    # e.g. "a:1:0.015625:2:1;b:1:0.015625:2:8" (name, longest first 0/1, HOT_SHARE, HOT_FACTOR, HOT_ALIGN optional)
    SETTINGS = [(n, bool(int(lf)), float(sh), float(fa), *[int(v) for v in al])
                for n, lf, sh, fa, *al in (c.split(":") for c in os.environ["AB_SETTINGS"].split(";"))]
ROUNDS = 3


def main() -> None:
    records = []
    shipped = (train_ops.GRADS_LONGEST_FIRST, train_ops.HOT_SHARE, train_ops.HOT_FACTOR, train_ops.HOT_ALIGN)
    for M, k, dist in CASES:
        s = make_ffn(M, 2048, 5632, k, dist, device="cuda")
        x, wg, wu, wd = (t.detach().requires_grad_(True) for t in (s.x, s.w_gate, s.w_up, s.w_down))
        dy = torch.randn_like(x) / math.sqrt(2048)
        dense = _dense_fn(x, wg, wu, wd, dy)
        for rnd in range(ROUNDS):
            for name, lf, share, hot, *align in SETTINGS:  # an optional fifth field: HOT_ALIGN
                align = align[0] if align else shipped[3]
                train_ops.GRADS_LONGEST_FIRST, train_ops.HOT_SHARE, train_ops.HOT_FACTOR, train_ops.HOT_ALIGN = lf, share, hot, align
                module, m = _module_fn(x, wg, wu, wd, dy, kernels="sparse")
                d_ms, m_ms = interleaved_ms([dense, module], calls=20, warmup=3)
                rec = dict(M=M, k=k, dist=dist, setting=name, longest_first=lf, hot_share=share, hot_factor=hot, hot_align=align, round=rnd,
                           dense_ms=d_ms, module_ms=m_ms, speedup=d_ms / m_ms, path=m.last_train_path)
                records.append(rec)
                print(f"M {M:6d} k {k:3g} {dist:7s} {name:36s} round {rnd}: dense {d_ms:.3f} module {m_ms:.3f} ms "
                      f"({rec['speedup']:.2f}x, {rec['path']})", flush=True)
                del module, m
        del s, x, wg, wu, wd, dy, dense
        torch.cuda.empty_cache()
    train_ops.GRADS_LONGEST_FIRST, train_ops.HOT_SHARE, train_ops.HOT_FACTOR, train_ops.HOT_ALIGN = shipped
    with open(os.path.join(OUT, "train_skewed_ab.json"), "w") as fh:
        json.dump(dict(machine=machine_info(), records=records), fh, indent=1)


if __name__ == "__main__":
    main()
