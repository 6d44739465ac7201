"""Device experiment: where the prefill kernels stop paying, by shape and batch, and whether the
default limit (``LayerState.limit``: the lower of 0.011 f and 62 active units per token) keeps
the module at or above dense there.

The thirtieth session predicted from two points per shape (k 29 and 56) that the break-even
at d 4096, f 11008 falls at 68 (M 16384) to 97 (M 65536) units per token on the H200, where
0.011 f had allowed 121. This sweeps k between those points with the inference grid's own
code (``twell.bench.inference.run_grid``: dense and the module timed in alternation, three
rounds, medians; the forced kernels too). Units are spread evenly, in bf16.

    python benchmarks/break_even_probe.py [OUTDIR]
    TIMED=1 python benchmarks/break_even_probe.py [OUTDIR]   # with twell.dispatch.TIMED_CHOICE on

Writes OUTDIR/break_even_probe.json (break_even_probe_timed.json with TIMED=1); prints the table last: per shape and M, the module's and
the forced kernels' ratio to dense at each k, and the break-even k interpolated from the
forced kernels.
"""

from __future__ import annotations

import json
import os
import sys

from twell.bench.inference import machine_info, run_grid
from twell import dispatch
from twell.dispatch import LayerState

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
SHAPES = [(4096, 11008), (2048, 5632)]
MS = (16384, 65536)
KS = (48, 56, 64, 72, 80, 96, 112, 128)


def break_even(recs: list[dict]) -> float | None:
    """The k where the forced kernels' ratio to dense crosses 1, linearly between the two
    records around it (None: no crossing in the sweep)."""
    pts = sorted((r["k_measured"], r["kernels_speedup"]) for r in recs if "kernels_speedup" in r)
    for (k0, s0), (k1, s1) in zip(pts, pts[1:]):
        if s0 >= 1.0 > s1:
            return k0 + (s0 - 1.0) * (k1 - k0) / (s0 - s1)
    return None


def main() -> None:
    timed = os.environ.get("TIMED") == "1"
    dispatch.TIMED_CHOICE = timed  # the layers time both paths near the limit (twell.path_timing)
    recs = run_grid(SHAPES, MS, KS, ["even"], rep=60, log=lambda s: print(s, flush=True))
    info = machine_info()
    limits = {f"{d}x{f}": LayerState.limit(f, None, d) for d, f in SHAPES}
    out = {"machine": info, "default_limit": limits, "timed_choice": timed, "records": recs}
    with open(os.path.join(OUT, f"break_even_probe{'_timed' if timed else ''}.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print(f"{'d':>5} {'M':>6} {'limit':>6} {'break-even':>10}  k: module x / kernels x")
    for d, f in SHAPES:
        for M in MS:
            rows = [r for r in recs if (r["d"], r["M"]) == (d, M)]
            be = break_even(rows)
            cells = " ".join(f"{r['k']}:{r['speedup']:.2f}/{r.get('kernels_speedup', float('nan')):.2f}" for r in rows)
            print(f"{d:>5} {M:>6} {out['default_limit'][f'{d}x{f}']:>6.1f} "
                  f"{'none' if be is None else f'{be:.0f}':>10}  {cells}")
    print("lowest module ratio:", min(r["speedup"] for r in recs))


if __name__ == "__main__":
    main()
