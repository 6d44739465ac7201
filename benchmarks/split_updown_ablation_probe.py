"""What bounds the split decode kernels after the gate: an ablation of the up/down launch (issue 9).

    OUT=DIR python benchmarks/split_updown_ablation_probe.py

After the gate the split kernels spend 4 to 11 us per layer (16 and 64 tokens, k 8 and 29;
benchmarks/split_stage_probe.py). The up/down launch walks the list of fires: per fire the
entry, the gate value, the up row, the x row and the down row, then d fp32 atomic adds into the
token's accumulator row. Here the up/down kernel is swapped, in the module's own launcher, for
variants that drop one part each (their results are wrong, on purpose; only their times count):

    shipped     the kernel as it ships
    stores      the adds as plain stores (same bytes, no atomics)
    no_down     no down row and no adds (a store of h only, so that the up product stays)
    list_only   only the entry and gate value of each fire (a store of their sum)
    empty       the launch and its wait for the gate, nothing else

Chain of LAYERS layers (one CUDA graph, no flush), us per layer; k in {8, 29} even, M in {16, 64}.
Writes OUT/split_updown_ablation_probe.json; prints a table.
"""

from __future__ import annotations

import json
import os

import torch
import triton
import triton.language as tl

import twell.kernels.decode_split as split
from twell.bench.inference import machine_info
from twell.bench.runtime import _pair, _warm
from twell.bench.synthetic import make_ffn
from twell.bench.timing import chain_graph_ms

LAYERS = 8
OUT = os.environ.get("OUT", "/tmp")


@triton.jit
def _ablated_updown_kernel(
    x_ptr, stride_xm, wu_ptr, stride_wu, wd_ptr, stride_wd,
    entry_ptr, gate_ptr, count_ptr, acc_ptr,
    d, capacity, P,
    BD: tl.constexpr, ONE_STEP: tl.constexpr, TOK: tl.constexpr, GATED: tl.constexpr, GDC: tl.constexpr,
    PART: tl.constexpr,
):
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n = tl.minimum(tl.load(count_ptr), capacity)
    cs = tl.arange(0, BD)
    cmask = cs < d
    if PART != 4:
        for i in range(pid, n, P):
            e = tl.load(entry_ptr + i)
            u = (e // TOK).to(tl.int64)
            m = (e % TOK).to(tl.int64)
            h = tl.load(gate_ptr + i).to(tl.float32)
            acc_row = acc_ptr + m * d
            if PART == 3:  # list only
                tl.store(acc_row + pid % BD, h + u.to(tl.float32))
            else:
                wu = tl.load(wu_ptr + u * stride_wu + cs, mask=cmask, other=0.0).to(tl.float32)
                xm = tl.load(x_ptr + m * stride_xm + cs, mask=cmask, other=0.0).to(tl.float32)
                h = h * tl.sum(wu * xm, axis=0).to(wu_ptr.dtype.element_ty).to(tl.float32)
                if PART == 2:  # no down
                    tl.store(acc_row + pid % BD, h)
                else:
                    wd = tl.load(wd_ptr + u * stride_wd + cs, mask=cmask, other=0.0).to(tl.float32)
                    if PART == 1:  # stores
                        tl.store(acc_row + cs, h * wd, mask=cmask)
                    else:
                        tl.atomic_add(acc_row + cs, h * wd, mask=cmask, sem="relaxed")


class _Variant:
    """Stands in for split._fire_updown_kernel: ``kernel[grid](...)`` with PART added."""

    def __init__(self, part: int):
        self.part = part

    def __getitem__(self, grid):
        def launch(*args, **kw):
            return _ablated_updown_kernel[grid](*args, PART=self.part, **kw)
        return launch


VARIANTS = {"shipped": None, "stores": 1, "no_down": 2, "list_only": 3, "empty": 4}


def main() -> None:
    records = []
    shipped = split._fire_updown_kernel
    for k in (8, 29):
        s = make_ffn(4096, 2048, 5632, k, "even", dtype=torch.bfloat16, device="cuda", seed=k + 23)
        pairs = [_pair(s) for _ in range(LAYERS)]
        dense = [p[0] for p in pairs]
        twell = [p[1] for p in pairs]
        for M in (16, 64):
            x = s.x[:M].contiguous()
            rec = dict(M=M, k=k, layers=LAYERS)
            with torch.no_grad():
                for t in twell:
                    _warm(t, x)
                    t.kernel_mode = "decode"
                rec["dense_us"] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in dense])
                for name, part in VARIANTS.items():
                    split._fire_updown_kernel = shipped if part is None else _Variant(part)
                    try:
                        rec[name] = 1e3 * chain_graph_ms([lambda m=m: m(x) for m in twell])
                        rec[name + " kernels"] = twell[0]._twell_layer.last_decode_kernels
                    finally:
                        split._fire_updown_kernel = shipped
                        for t in twell:
                            t._twell_layer.split_scratch.reset()
            records.append(rec)
            print(f"k {k:2d} M {M:2d} dense {rec['dense_us']:5.1f} | "
                  + " ".join(f"{n} {rec[n]:5.1f}" for n in VARIANTS), flush=True)
        del s, pairs, dense, twell
        torch.cuda.empty_cache()
    with open(os.path.join(OUT, "split_updown_ablation_probe.json"), "w") as fh:
        json.dump(dict(**machine_info(), layers=LAYERS, records=records), fh, indent=1)


if __name__ == "__main__":
    main()
