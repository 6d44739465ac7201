"""Device experiment: L2 eviction hints on the gather kernels (training rows kernels, weight
gradients, inference up/down). `benchmarks/train_l2_probe.py` found the training rows kernels
20 to 35% faster when their weights fit in L2; these kernels also stream token rows (x, dy in;
y, dx out) through L2, each used once, which may push the weight rows out.

Variants are made from the shipped source: each `tl.load` / `tl.store` line that matches a rule
gets an `eviction_policy`, the text is written next to the original as a private module
(`twell/kernels/_ev_*.py`, on the device's copy of the tree only) and imported. Outputs are
compared with the shipped kernels' (bitwise: a hint changes no arithmetic).

    python benchmarks/evict_probe.py [OUTDIR]

Writes OUTDIR/evict_probe.json; prints a table last.
"""

from __future__ import annotations

import importlib
import json
import os
import sys

import torch

import twell.kernels as tk
from twell.bench.inference import bench_ms, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import pack_relu
from twell.kernels import train_ffn as K
from twell.kernels import updown as U
from twell.kernels.train_index import unit_index
from twell.ops import DEFAULT_COMPRESSION, default_tile, prepare_gated_weights
from twell.train_ops import GRADS_CONFIG, ROWS_CONFIG

from train_l2_probe import training_case  # (benchmarks/ is on the path)

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
D, F = 2048, 5632

# rule name -> (substrings a tl.load / tl.store line must contain, policy)
RULES = {
    "keep_w": (["wu_ptr + j[:, None]", "wdt_ptr + j[:, None]", "wg_ptr + j[:, None]",
                "wu_ptr + unit[:, None]", "wd_ptr + unit[:, None]"], "evict_last"),
    "stream_in": (["x_ptr + m * stride_xm", "dy_ptr + m * stride_dym"], "evict_first"),
    "stream_out": (["tl.store(y_ptr + m", "tl.store(dx_ptr + m", "tl.store(u_ptr + row", "tl.store(du_ptr + row",
                    "tl.store(da_ptr + row", "tl.store(dwu_ptr", "tl.store(dwdt_ptr", "tl.store(dwg_ptr"], "evict_first"),
    "keep_tok": (["x_ptr + m[:, None]", "dy_ptr + m[:, None]"], "evict_last"),
}
VARIANTS = {
    "base": [],
    "keep_w": ["keep_w"],
    "stream": ["stream_in", "stream_out"],
    "keep_w+stream": ["keep_w", "stream_in", "stream_out"],
    "keep_w+stream+keep_tok": ["keep_w", "stream_in", "stream_out", "keep_tok"],
}


def _close(line: str, start: int) -> int:
    depth = 0
    for i in range(start, len(line)):
        if line[i] == "(":
            depth += 1
        elif line[i] == ")":
            depth -= 1
            if depth == 0:
                return i
    return -1


def patched_source(src: str, rules: list[str]) -> tuple[str, dict]:
    lines, hits = src.split("\n"), {r: 0 for r in rules}
    for i, line in enumerate(lines):
        for r in rules:
            subs, policy = RULES[r]
            for call in ("tl.load(", "tl.store("):
                at = line.find(call)
                if at < 0 or not any(s in line for s in subs) or "eviction_policy" in line:
                    continue
                end = _close(line, at + len(call) - 1)
                if end < 0:
                    continue
                line = line[:end] + f", eviction_policy=\"{policy}\"" + line[end:]
                hits[r] += 1
        lines[i] = line
    return "\n".join(lines), hits


def variant_module(base_mod, variant: str):
    name = f"_ev_{variant.replace('+', '_')}_{base_mod.__name__.rsplit('.', 1)[1]}"
    src, hits = patched_source(open(base_mod.__file__).read(), VARIANTS[variant])
    with open(os.path.join(os.path.dirname(tk.__file__), name + ".py"), "w") as fh:
        fh.write(src)
    return importlib.import_module(f"twell.kernels.{name}"), hits


def main() -> None:
    info, out = machine_info(), {"train": {}, "infer": {}, "hits": {}}
    # training, M 16384 k 29 even
    t = training_case(16384, 29)
    x, wg, wu, dy, W, wdt, cols, g, cnt, c = t.x, t.wg, t.wu, t.dy, t.W, t.wdt, t.cols, t.g, t.cnt, t.c
    y0, u0, l0 = K.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **ROWS_CONFIG)
    b0 = K.ffn_rows_backward(dy, cols, g, u0, cnt, wdt, wu, wg, c, **ROWS_CONFIG)
    order, offsets = unit_index(cols, cnt, F)
    g0 = K.ffn_weight_grads(order, offsets, x, dy, g, u0, b0[1], b0[2], dtype=wu.dtype, **GRADS_CONFIG)
    # inference, M 131072 and 16384, k 29 even
    inf = {}
    for Mi in (131072, 16384):
        si = make_ffn(Mi, D, F, 29, "even", torch.bfloat16, "cuda", seed=Mi + 29 + D)
        w = prepare_gated_weights(si.w_up, si.w_down)
        pre = torch.mm(si.x, si.w_gate.T)
        gi = pack_relu(pre, default_tile(F), DEFAULT_COMPRESSION)
        be, nw = U.default_config(D, 29.0)
        ref = U.ffn_from_twell(si.x, gi, w.down_t, w_up=w.up, pre=pre, block_e=be, num_warps=nw)
        inf[Mi] = (si.x, w, pre, gi, be, nw, ref)
    mods = {}
    for v in VARIANTS:
        Kv, hk = variant_module(K, v)
        Uv, hu = variant_module(U, v)
        mods[v] = (Kv, Uv)
        out["hits"][v] = {"train_ffn": hk, "updown": hu}
        print(f"{v}: lines hinted train_ffn {hk}, updown {hu}", flush=True)
    same = {}
    for v, (Kv, Uv) in mods.items():
        y, u, l1 = Kv.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **ROWS_CONFIG)
        b = Kv.ffn_rows_backward(dy, cols, g, u, cnt, wdt, wu, wg, c, **ROWS_CONFIG)
        gr = Kv.ffn_weight_grads(order, offsets, x, dy, g, u, b[1], b[2], dtype=wu.dtype, **GRADS_CONFIG)
        ok = torch.equal(y, y0) and torch.equal(u, u0) and torch.equal(l1, l0) and all(torch.equal(p, q) for p, q in zip(b, b0)) \
            and all(torch.equal(p, q) for p, q in zip(gr, g0))
        for Mi, (xi, w, pre, gi, be, nw, ref) in inf.items():
            ok = ok and torch.equal(Uv.ffn_from_twell(xi, gi, w.down_t, w_up=w.up, pre=pre, block_e=be, num_warps=nw), ref)
        same[v] = bool(ok)
    out["same"] = same
    times: dict = {}
    for rnd in range(3):
        for v, (Kv, Uv) in mods.items():
            cases = {
                "train_fwd_rows": lambda: Kv.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **ROWS_CONFIG),
                "train_bwd_rows": lambda: Kv.ffn_rows_backward(dy, cols, g, u0, cnt, wdt, wu, wg, c, **ROWS_CONFIG),
                "train_wgrads": lambda: Kv.ffn_weight_grads(order, offsets, x, dy, g, u0, b0[1], b0[2], dtype=wu.dtype, **GRADS_CONFIG),
            }
            for Mi, (xi, w, pre, gi, be, nw, ref) in inf.items():
                cases[f"infer_updown_{Mi}"] = (lambda xi=xi, w=w, pre=pre, gi=gi, be=be, nw=nw:
                                              Uv.ffn_from_twell(xi, gi, w.down_t, w_up=w.up, pre=pre, block_e=be, num_warps=nw))
            for name, fn in cases.items():
                times.setdefault(name, {}).setdefault(v, []).append(bench_ms(fn, rep=50))
    out["ms"] = {n: {v: sorted(t)[1] for v, t in per.items()} for n, per in times.items()}
    out["rounds"] = times
    out.update(info, W=W)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "evict_probe.json"), "w") as fh:
        json.dump(out, fh, indent=1)
    print("same outputs as shipped:", same)
    vs = list(VARIANTS)
    print(f"{'kernel':22s} " + " ".join(f"{v:>22s}" for v in vs))
    for n, per in out["ms"].items():
        print(f"{n:22s} " + " ".join(f"{per[v]:22.4f}" for v in vs))


if __name__ == "__main__":
    main()
