"""Issue 9 at d 4096: does the split decode kernels' fire limit (``dispatch.SPLIT_MAX_FIRES``,
4096 expected fires per call, fitted at d 2048) hold at a wider layer?

At d 2048 (H200) the split kernels cost about 17 to 21 us plus 4 to 5 ns a fire against dense's
40 us, so 4096 fires sat near 0.9 of dense. At d 4096, f 11008 (H100 decode grid of the
thirty-fifth session) they cost about 44 us plus 10 ns a fire against dense's 112 us: break-even
near 7000 fires. This times the decode grid's records (the module in CUDA graphs, eight layers
chained, as `twell bench decode` does) at batches whose expected fires pass 4096, once with the
default limits and once with them lifted (the split kernels then take every batch up to 64
tokens), at d 4096 and, as a check of the fitted limit, at d 2048.

The first run (fifty-second session, H200) set ``dispatch.SPLIT_MAX_FIRES_BY_D`` and
``FUSED_WIDE_M_BY_D`` for d 4096; the third group of cases, around those limits, checks them.

    OUT=dir python benchmarks/decode_split_fires_probe.py   # writes OUT/split_fires_probe.json
"""

import json
import os

from twell import dispatch
from twell.bench.runtime import decode_grid

CASES = [  # (d, f, Ms, ks, distributions)
    (4096, 11008, (16, 32, 64), (80, 280), ("even", "heavy")),
    (4096, 11008, (64,), (29, 56), ("heavy",)),
    (4096, 11008, (24, 32, 48), (40, 60, 100, 120), ("even", "heavy")),
    (2048, 5632, (32, 64), (80, 160), ("even",)),
]
default = dispatch.SPLIT_MAX_FIRES, dict(dispatch.SPLIT_MAX_FIRES_BY_D)
lifted = 1 << 30, {key: (1 << 30, 1 << 30) for key in dispatch.SPLIT_MAX_FIRES_BY_D}
out = []
for d, f, Ms, ks, dists in CASES:
    for name, (limit, by_d) in (("default", default), ("lifted", lifted)):
        dispatch.SPLIT_MAX_FIRES, dispatch.SPLIT_MAX_FIRES_BY_D = limit, by_d
        for r in decode_grid(Ms=Ms, ks=ks, dists=dists, d=d, f=f, log=lambda s: None):
            r["limit"] = name
            out.append(r)
            print(f"d {d} M {r['M']:3d} k {r['k']:3d} {r['distribution']:6s} {name:7s} dense {r['dense_graph_us']:6.1f} "
                  f"auto {r['twell_graph_us']:6.1f} ({r['path']}, {r['decode_kernels']}) x{r['speedup']:.2f} "
                  f"forced {r['decode_graph_us']:6.1f} ({r['forced_decode_kernels']}) x{r['decode_speedup']:.2f} "
                  f"err {r['rel_err']:.1e}", flush=True)
        # after each group: a run cut short by its time limit keeps what it measured
        with open(os.path.join(os.environ.get("OUT", "/tmp"), "split_fires_probe.json"), "w") as fh:
            json.dump(out, fh, indent=1)
dispatch.SPLIT_MAX_FIRES, dispatch.SPLIT_MAX_FIRES_BY_D = default
