"""Device experiment: the gather kernels split by weight matrix, so that each launch's weight rows
fit in L2. `benchmarks/train_l2_probe.py` found the training rows kernels 20 to 35% faster with a
23 MB working set than with their 46 MB (forward: w_up, w_down^T) or 69 MB (backward: w_down^T,
w_up, w_gate); H200's L2 is 50 MB.

Prototype kernels (this file only), same arithmetic in the same order as the shipped fused ones:
- training forward: up (u = x . w_up[j], stored) then down (y = sum g u w_down^T[j], l1);
- training backward: dh (from w_down^T: du, da stored) then dx (from w_up and w_gate);
- inference up/down from TwELL (no overflowed tile in these cases): up (h = g (x . w_up[j])
  stored in fp32 at the entry's place) then down (y = sum h w_down^T[j]).

    python benchmarks/split_phase_probe.py [OUTDIR]

Writes OUTDIR/split_phase_probe.json; prints a table last.
"""

from __future__ import annotations

import json
import math
import os
import sys

import torch
import triton
import triton.language as tl

from twell.bench.inference import bench_ms, machine_info
from twell.bench.synthetic import make_ffn
from twell.kernels import pack_relu
from twell.kernels import train_ffn as K
from twell.kernels import updown as U
from twell.ops import DEFAULT_COMPRESSION, default_tile, prepare_gated_weights
from twell.train_ops import PACK_CONFIG, ROWS_CONFIG, choose_width

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
D, F = 2048, 5632


@triton.jit
def _t_up(x_ptr, col_ptr, cnt_ptr, wu_ptr, u_ptr, d, W, BE: tl.constexpr, DP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cnt = tl.load(cnt_ptr + m)
    n = tl.where(cnt > W, 0, cnt)
    es = tl.arange(0, BE)
    dd = tl.arange(0, DP)
    dm = dd < d
    row = m * W
    x = tl.load(x_ptr + m * d + dd, mask=dm, other=0.0).to(tl.float32)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid = s < n
        j = tl.load(col_ptr + row + s, mask=valid, other=0).to(tl.int64)
        w = tl.load(wu_ptr + j[:, None] * d + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        u = tl.sum(w.to(tl.float32) * x[None, :], axis=1).to(u_ptr.dtype.element_ty)
        tl.store(u_ptr + row + s, u, mask=valid)
    for s0 in range(0, W, BE):
        s = s0 + es
        tl.store(u_ptr + row + s, tl.zeros([BE], dtype=u_ptr.dtype.element_ty), mask=(s >= n) & (s < W))


@triton.jit
def _t_down(col_ptr, g_ptr, u_ptr, cnt_ptr, wdt_ptr, y_ptr, l1_ptr, d, W, BE: tl.constexpr, DP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cnt = tl.load(cnt_ptr + m)
    n = tl.where(cnt > W, 0, cnt)
    es = tl.arange(0, BE)
    dd = tl.arange(0, DP)
    dm = dd < d
    row = m * W
    acc = tl.zeros([DP], dtype=tl.float32)
    l1 = tl.sum(tl.zeros([BE], dtype=tl.float32), axis=0)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid = s < n
        j = tl.load(col_ptr + row + s, mask=valid, other=0).to(tl.int64)
        h = tl.load(g_ptr + row + s, mask=valid, other=0.0).to(tl.float32) * tl.load(u_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
        l1 += tl.sum(tl.abs(h), axis=0)
        wd = tl.load(wdt_ptr + j[:, None] * d + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
    tl.store(y_ptr + m * d + dd, acc.to(y_ptr.dtype.element_ty), mask=dm)
    tl.store(l1_ptr + m, l1)


@triton.jit
def _t_dh(dy_ptr, col_ptr, g_ptr, u_ptr, cnt_ptr, wdt_ptr, c_ptr, du_ptr, da_ptr, d, W, BE: tl.constexpr, DP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cnt = tl.load(cnt_ptr + m)
    n = tl.where(cnt > W, 0, cnt)
    es = tl.arange(0, BE)
    dd = tl.arange(0, DP)
    dm = dd < d
    row = m * W
    c = tl.load(c_ptr)
    dyv = tl.load(dy_ptr + m * d + dd, mask=dm, other=0.0).to(tl.float32)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid = s < n
        j = tl.load(col_ptr + row + s, mask=valid, other=0).to(tl.int64)
        wd = tl.load(wdt_ptr + j[:, None] * d + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        g = tl.load(g_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
        u = tl.load(u_ptr + row + s, mask=valid, other=0.0).to(tl.float32)
        h = g * u
        sign = tl.where(h > 0, 1.0, tl.where(h < 0, -1.0, 0.0))
        dh = tl.sum(wd.to(tl.float32) * dyv[None, :], axis=1) + c * sign
        tl.store(du_ptr + row + s, dh * g, mask=valid)
        tl.store(da_ptr + row + s, dh * u, mask=valid)


@triton.jit
def _t_dx(col_ptr, du_ptr, da_ptr, cnt_ptr, wu_ptr, wg_ptr, dx_ptr, d, W, BE: tl.constexpr, DP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    cnt = tl.load(cnt_ptr + m)
    n = tl.where(cnt > W, 0, cnt)
    es = tl.arange(0, BE)
    dd = tl.arange(0, DP)
    dm = dd < d
    row = m * W
    acc = tl.zeros([DP], dtype=tl.float32)
    for s0 in range(0, n, BE):
        s = s0 + es
        valid = s < n
        j = tl.load(col_ptr + row + s, mask=valid, other=0).to(tl.int64)
        wmask = valid[:, None] & dm[None, :]
        du = tl.load(du_ptr + row + s, mask=valid, other=0.0)
        da = tl.load(da_ptr + row + s, mask=valid, other=0.0)
        wu = tl.load(wu_ptr + j[:, None] * d + dd[None, :], mask=wmask, other=0.0)
        wg = tl.load(wg_ptr + j[:, None] * d + dd[None, :], mask=wmask, other=0.0)
        acc += tl.sum(du[:, None] * wu.to(tl.float32) + da[:, None] * wg.to(tl.float32), axis=0)
    tl.store(dx_ptr + m * d + dd, acc.to(dx_ptr.dtype.element_ty), mask=dm)


@triton.jit
def _i_entries(m, e, incl, excl, tiles, SLOTS, N_TILES, TILE):
    t_e = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)
    base = tl.sum(tl.where(tiles[None, :] == t_e[:, None], excl[None, :], 0), axis=1)
    off = m * N_TILES * SLOTS + t_e * SLOTS + (e - base)
    return off, t_e


@triton.jit
def _i_up(x_ptr, cnt_ptr, val_ptr, col_ptr, wu_ptr, stride_wu, h_ptr, d, SLOTS, N_TILES, TILE,
          DP: tl.constexpr, BE: tl.constexpr, NTP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, DP)
    dm = dd < d
    tiles = tl.arange(0, NTP)
    cnt = tl.load(cnt_ptr + m * N_TILES + tiles, mask=tiles < N_TILES, other=0)
    c = tl.where(cnt > SLOTS, 0, cnt)
    incl = tl.cumsum(c, axis=0)
    excl = incl - c
    n_entries = tl.sum(c, axis=0)
    x = tl.load(x_ptr + m * d + dd, mask=dm, other=0.0).to(tl.float32)
    for e0 in range(0, n_entries, BE):
        e = e0 + tl.arange(0, BE)
        valid = e < n_entries
        off, t_e = _i_entries(m, e, incl, excl, tiles, SLOTS, N_TILES, TILE)
        col = tl.load(col_ptr + off, mask=valid, other=0).to(tl.int32)
        v = tl.load(val_ptr + off, mask=valid, other=0.0).to(tl.float32)
        unit = (t_e * TILE + col).to(tl.int64)
        wu = tl.load(wu_ptr + unit[:, None] * stride_wu + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        tl.store(h_ptr + off, v * tl.sum(wu.to(tl.float32) * x[None, :], axis=1), mask=valid)


@triton.jit
def _i_down(cnt_ptr, col_ptr, h_ptr, wd_ptr, stride_wd, y_ptr, d, SLOTS, N_TILES, TILE,
            DP: tl.constexpr, BE: tl.constexpr, NTP: tl.constexpr):
    m = tl.program_id(0).to(tl.int64)
    dd = tl.arange(0, DP)
    dm = dd < d
    tiles = tl.arange(0, NTP)
    cnt = tl.load(cnt_ptr + m * N_TILES + tiles, mask=tiles < N_TILES, other=0)
    c = tl.where(cnt > SLOTS, 0, cnt)
    incl = tl.cumsum(c, axis=0)
    excl = incl - c
    n_entries = tl.sum(c, axis=0)
    acc = tl.zeros([DP], dtype=tl.float32)
    for e0 in range(0, n_entries, BE):
        e = e0 + tl.arange(0, BE)
        valid = e < n_entries
        off, t_e = _i_entries(m, e, incl, excl, tiles, SLOTS, N_TILES, TILE)
        col = tl.load(col_ptr + off, mask=valid, other=0).to(tl.int32)
        h = tl.load(h_ptr + off, mask=valid, other=0.0).to(tl.float32)
        unit = (t_e * TILE + col).to(tl.int64)
        wd = tl.load(wd_ptr + unit[:, None] * stride_wd + dd[None, :], mask=valid[:, None] & dm[None, :], other=0.0)
        acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
    tl.store(y_ptr + m * d + dd, acc.to(y_ptr.dtype.element_ty), mask=dm)


def main() -> None:
    res: dict = {"train": {}, "infer": {}}
    DP = triton.next_power_of_2(D)
    # ---- training, M 16384, k 29 even
    M = 16384
    s = make_ffn(M, D, F, 29, "even", torch.bfloat16, "cuda", seed=1)
    x, wg, wu, wd = s.x, s.w_gate, s.w_up, s.w_down
    dy = torch.randn(M, D, device="cuda", dtype=torch.bfloat16) / math.sqrt(D)
    with torch.no_grad():
        a = torch.mm(x, wg.t())
    W = choose_width(float((a > 0).sum(1).float().mean()), None, F)
    wdt = wd.t().contiguous()
    cols, g, cnt = K.pack_rows(a, W, **PACK_CONFIG)
    c = torch.full((1,), 1e-3, device="cuda")
    y0, u0, l0 = K.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **ROWS_CONFIG)
    dx0, du0, da0 = K.ffn_rows_backward(dy, cols, g, u0, cnt, wdt, wu, wg, c, **ROWS_CONFIG)
    used = torch.arange(W, device="cuda")[None, :] < torch.where(cnt > W, 0, cnt)[:, None]
    u1 = torch.empty_like(u0)
    y1 = torch.empty_like(y0)
    l1 = torch.empty_like(l0)
    du1, da1 = torch.empty_like(du0), torch.empty_like(da0)
    dx1 = torch.empty_like(dx0)

    def fwd(be, nw):
        _t_up[(M,)](x, cols, cnt, wu, u1, D, W, BE=be, DP=DP, num_warps=nw)
        _t_down[(M,)](cols, g, u1, cnt, wdt, y1, l1, D, W, BE=be, DP=DP, num_warps=nw)

    def bwd(be, nw):
        _t_dh[(M,)](dy, cols, g, u0, cnt, wdt, c, du1, da1, D, W, BE=be, DP=DP, num_warps=nw)
        _t_dx[(M,)](cols, du1, da1, cnt, wu, wg, dx1, D, W, BE=be, DP=DP, num_warps=nw)

    fwd(2, 4)
    bwd(2, 4)
    res["train"]["same"] = dict(
        u=bool(torch.equal(u1, u0)), y=bool(torch.equal(y1, y0)), l1=bool(torch.equal(l1, l0)),
        du=bool(torch.equal(du1[used], du0[used])), da=bool(torch.equal(da1[used], da0[used])), dx=bool(torch.equal(dx1, dx0)))
    t = {}
    cfgs = [(2, 4), (4, 4), (2, 8), (1, 4)]
    for _ in range(3):
        t.setdefault("fused_fwd", []).append(bench_ms(lambda: K.ffn_rows_forward(x, cols, g, cnt, wdt, wu, **ROWS_CONFIG), rep=50))
        t.setdefault("fused_bwd", []).append(bench_ms(lambda: K.ffn_rows_backward(dy, cols, g, u0, cnt, wdt, wu, wg, c, **ROWS_CONFIG), rep=50))
        for be, nw in cfgs:
            t.setdefault(f"split_fwd_{be}x{nw}", []).append(bench_ms(lambda: fwd(be, nw), rep=50))
            t.setdefault(f"split_bwd_{be}x{nw}", []).append(bench_ms(lambda: bwd(be, nw), rep=50))
            t.setdefault(f"  up_{be}x{nw}", []).append(bench_ms(lambda: _t_up[(M,)](x, cols, cnt, wu, u1, D, W, BE=be, DP=DP, num_warps=nw), rep=50))
            t.setdefault(f"  down_{be}x{nw}", []).append(bench_ms(lambda: _t_down[(M,)](cols, g, u1, cnt, wdt, y1, l1, D, W, BE=be, DP=DP, num_warps=nw), rep=50))
            t.setdefault(f"  dh_{be}x{nw}", []).append(bench_ms(lambda: _t_dh[(M,)](dy, cols, g, u0, cnt, wdt, c, du1, da1, D, W, BE=be, DP=DP, num_warps=nw), rep=50))
            t.setdefault(f"  dx_{be}x{nw}", []).append(bench_ms(lambda: _t_dx[(M,)](cols, du1, da1, cnt, wu, wg, dx1, D, W, BE=be, DP=DP, num_warps=nw), rep=50))
    res["train"]["ms"] = {n: sorted(v)[1] for n, v in t.items()}
    res["train"]["rounds"] = t
    # ---- inference, M 131072 and 16384, k 29 even
    for Mi in (131072, 16384):
        si = make_ffn(Mi, D, F, 29, "even", torch.bfloat16, "cuda", seed=Mi + 29 + D)
        w = prepare_gated_weights(si.w_up, si.w_down)
        pre = torch.mm(si.x, si.w_gate.T)
        gi = pack_relu(pre, default_tile(F), DEFAULT_COMPRESSION)
        be0, nw0 = U.default_config(D, 29.0)
        ref = U.ffn_from_twell(si.x, gi, w.down_t, w_up=w.up, pre=pre, block_e=be0, num_warps=nw0)
        h = torch.empty(gi.values.shape, dtype=torch.float32, device="cuda")
        y = torch.empty_like(si.x)
        NTP = triton.next_power_of_2(gi.n_tiles)
        assert si.x.is_contiguous() and w.up.stride(1) == 1 and w.down_t.stride(1) == 1

        def split(be, nw, xx=si.x, gg=gi, ww=w, hh=h, yy=y, Mi=Mi):
            _i_up[(Mi,)](xx, gg.counts, gg.values, gg.cols, ww.up, ww.up.stride(0), hh, D, gg.slots, gg.n_tiles, gg.tile,
                         DP=DP, BE=be, NTP=NTP, num_warps=nw)
            _i_down[(Mi,)](gg.counts, gg.cols, hh, ww.down_t, ww.down_t.stride(0), yy, D, gg.slots, gg.n_tiles, gg.tile,
                           DP=DP, BE=be, NTP=NTP, num_warps=nw)

        split(be0, nw0)
        r = {"same_y": bool(torch.equal(y, ref)), "max_abs_diff": float((y.float() - ref.float()).abs().max()),
             "overflow": int((gi.counts > gi.slots).sum()), "fused_stride_up": w.up.stride(0)}
        t = {}
        for _ in range(3):
            t.setdefault("fused", []).append(bench_ms(lambda: U.ffn_from_twell(si.x, gi, w.down_t, w_up=w.up, pre=pre, block_e=be0, num_warps=nw0), rep=50))
            for be, nw in cfgs:
                t.setdefault(f"split_{be}x{nw}", []).append(bench_ms(lambda: split(be, nw), rep=50))
        r["ms"] = {n: sorted(v)[1] for n, v in t.items()}
        r["rounds"] = t
        res["infer"][Mi] = r
    res.update(machine_info(), W=W)
    os.makedirs(OUT, exist_ok=True)
    with open(os.path.join(OUT, "split_phase_probe.json"), "w") as fh:
        json.dump(res, fh, indent=1)
    print("training same as fused:", res["train"]["same"])
    for n, v in res["train"]["ms"].items():
        print(f"train {n:22s} {v:.4f} ms")
    for Mi, r in res["infer"].items():
        print(f"infer M {Mi}: same {r['same_y']} (max diff {r['max_abs_diff']:.2e}, overflow tiles {r['overflow']}, up stride {r['fused_stride_up']})")
        for n, v in r["ms"].items():
            print(f"infer {Mi} {n:18s} {v:.4f} ms")


if __name__ == "__main__":
    main()
