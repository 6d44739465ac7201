"""Issue 9: where does the fused decode kernel's time go at 16 to 64 tokens, and which gate
product reaches HBM bandwidth there? One device call.

The fused kernel (``twell.kernels.decode_fused``) reads at about 0.9 TB/s from 6 tokens up
(benchmarks/NOTES_decode.md: 28.6 us at 16 tokens, k 29, against a 5.5 us byte floor). Its
gate walks d in dependent steps on 16-row tensor-core tiles, 88 programs of 64 units. This
probe times, in CUDA graphs with L2 flushed before each replay (d 2048, f 5632, bf16):

- dense (three-Linear MLP) and the cuBLAS gate alone;
- the shipped fused kernel on real inputs (k 29 even) and on x = 0 (no unit fires: its gate
  and fixed costs only);
- stand-alone Triton gate products ``a = x w^T -> [M, f]`` in two orientations: ``xw`` (the
  fused kernel's: tokens as the dot's rows) and ``wx`` (units as the rows, ``a^T = w x^T``,
  so that a 64-unit tile is a Hopper warpgroup MMA's 64 rows), over block shapes, and ``wx``
  split over d (``S`` programs per unit block, fp32 partial sums: what a split gate would
  write for the next kernel to sum);
- the whole fused FFN in the ``wx`` orientation (``fwx``: gate, up and down with units as the
  dots' rows; the accumulator zeroed and cast by PyTorch around it, three launches) at k 8, 29
  and 56, worst-row error against fp32 (dense bf16's is about 4e-3);
- ``cmp``: the shipped kernel's gate, then the block's active units compacted into groups of
  NA, up and down on ``[*, NA]`` tiles in a few long steps (written after the first call showed
  the up and down phases, not the gate, cost the shipped kernel its time), with the shipped
  write-out (kept accumulator and PDL up to 16 tokens).

    python benchmarks/decode_gate_probe.py [OUTDIR]
    python benchmarks/decode_gate_probe.py [OUTDIR] --compact   # dense, shipped and compacted kernels only
    python benchmarks/decode_gate_probe.py [OUTDIR] --decompose # the compacted kernel with parts switched off
    python benchmarks/decode_gate_probe.py [OUTDIR] --chain     # 1 to 8 layers back to back in one graph
    python benchmarks/decode_gate_probe.py [OUTDIR] --merged    # up and down rows loaded in one round
    python benchmarks/decode_gate_probe.py [OUTDIR] --configs   # the shipped kernel at other shapes
    python benchmarks/decode_gate_probe.py [OUTDIR] --split     # gate, per-unit up/down, write-out: 3 PDL launches
    python benchmarks/decode_gate_probe.py [OUTDIR] --split --fire  # the same with the list and the up/down per
        # firing token (written after call 9), 1 to 256 tokens
    TRITON_INTERPRET=1 python benchmarks/decode_gate_probe.py /tmp --smoke   # CPU, tiny, untimed

Writes OUTDIR/decode_gate_probe.json; prints a table (us, TB/s of the gate's weight bytes).
"""

from __future__ import annotations

import json
import os
import sys
import traceback

import torch
import triton
import triton.language as tl

from twell.kernels._launch import pdl_ok
from twell.kernels.decode import _rows_times_units
from twell.kernels.decode_fused import _write_out_kernel

OUT = sys.argv[1] if len(sys.argv) > 1 else os.environ.get("OUT", "/tmp")
SMOKE = "--smoke" in sys.argv
D, F = (64, 320) if SMOKE else (2048, 5632)
DEVICE = "cpu" if SMOKE else "cuda"
DTYPE = torch.float32 if SMOKE else torch.bfloat16
MS = (16,) if SMOKE else (8, 16, 32, 64)


@triton.jit
def _gate_xw_kernel(x_ptr, sxm, w_ptr, sw, out_ptr, M, d, f, BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr):
    # a[rows, units] = x[rows] . w[units]: tokens as the dot's rows (the fused kernel's orientation)
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BU], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        xa = tl.load(x_ptr + rows[:, None] * sxm + kk[None, :], mask=rmask[:, None], other=0.0)
        w = tl.load(w_ptr + units.to(tl.int64)[None, :] * sw + kk[:, None], mask=umask[None, :], other=0.0)
        acc = tl.dot(xa, w, acc)
    tl.store(out_ptr + rows[:, None] * f + units[None, :], acc.to(out_ptr.dtype.element_ty), mask=rmask[:, None] & umask[None, :])


@triton.jit
def _gate_wx_kernel(x_ptr, sxm, w_ptr, sw, out_ptr, part_ptr, M, d, f,
                    BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, S: tl.constexpr):
    # a^T[units, rows] = w[units] . x[rows]: units as the dot's rows; with S > 1 program (b, s)
    # sums d's s-th share and writes fp32 partials part[s, rows, units]
    b = tl.program_id(0)
    s = tl.program_id(1)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    ks = tl.arange(0, BK)
    acc = tl.zeros([BU, BM], dtype=tl.float32)
    share = d // S
    for k0 in range(s * share, (s + 1) * share, BK):
        kk = k0 + ks
        w = tl.load(w_ptr + units.to(tl.int64)[:, None] * sw + kk[None, :], mask=umask[:, None], other=0.0)
        xt = tl.load(x_ptr + rows[None, :] * sxm + kk[:, None], mask=rmask[None, :], other=0.0)
        acc = tl.dot(w, xt, acc)
    if S == 1:
        tl.store(out_ptr + rows[None, :] * f + units[:, None], acc.to(out_ptr.dtype.element_ty), mask=rmask[None, :] & umask[:, None])
    else:
        tl.store(part_ptr + (s * M + rows[None, :]) * f + units[:, None], acc, mask=rmask[None, :] & umask[:, None])


@triton.jit
def _fused_wx_kernel(x_ptr, sxm, wf_ptr, swf, wu_ptr, swu, wd_ptr, swd, acc_ptr, M, d, f,
                     BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, BD: tl.constexpr):
    # the fused decode FFN with units as the dots' rows: a^T = w_gate x^T, u^T = w_up x^T over
    # the block's active units, y^T += w_down_t^T h^T (fp32 atomic adds, rows with an active unit)
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    ks = tl.arange(0, BK)
    a = tl.zeros([BU, BM], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        w = tl.load(wf_ptr + units.to(tl.int64)[:, None] * swf + kk[None, :], mask=umask[:, None], other=0.0)
        xt = tl.load(x_ptr + rows[None, :] * sxm + kk[:, None], mask=rmask[None, :], other=0.0)
        a = tl.dot(w, xt, a)
    a = a.to(wf_ptr.dtype.element_ty).to(tl.float32)
    fires = (a > 0) & umask[:, None] & rmask[None, :]
    active = tl.max(fires.to(tl.int32), axis=1) > 0
    per_row = tl.sum(fires.to(tl.int32), axis=0)
    if tl.sum(active.to(tl.int32), axis=0) > 0:
        u = tl.zeros([BU, BM], dtype=tl.float32)
        for k0 in range(0, d, BK):
            kk = k0 + ks
            w = tl.load(wu_ptr + units.to(tl.int64)[:, None] * swu + kk[None, :], mask=active[:, None], other=0.0)
            xt = tl.load(x_ptr + rows[None, :] * sxm + kk[:, None], mask=rmask[None, :], other=0.0)
            u = tl.dot(w, xt, u)
        h = tl.where(fires, a, 0.0) * u.to(wu_ptr.dtype.element_ty).to(tl.float32)
        hb = h.to(wd_ptr.dtype.element_ty)
        cs = tl.arange(0, BD)
        for d0 in range(0, d, BD):
            cols = d0 + cs
            wt = tl.load(wd_ptr + units.to(tl.int64)[None, :] * swd + cols[:, None], mask=active[None, :], other=0.0)
            part = tl.dot(wt, hb)  # [BD, BM]
            tl.atomic_add(acc_ptr + rows[None, :] * d + cols[:, None], part, mask=(per_row > 0)[None, :], sem="relaxed")


@triton.jit
def _fused_compact_kernel(x_ptr, sxm, wf_ptr, swf, wu_ptr, swu, wd_ptr, swd, acc_ptr, M, d, f,
                          BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, NA: tl.constexpr,
                          BKU: tl.constexpr, BD: tl.constexpr, SU: tl.constexpr, GDC: tl.constexpr,
                          MODE: tl.constexpr = 0, dbg_ptr=None):
    # MODE (for the decomposition): 0 all; 1 down only (u = 1); 2 up only (h summed into dbg);
    # 3 adds as plain stores (wrong sums: timing only); 4 nothing after the block's activity
    # the shipped kernel's gate, then the block's active units compacted into groups of NA: the
    # up and down products run on [*, NA] tiles in steps of BKU / BD columns (few, long steps:
    # the up and down phases of the shipped kernel are chains of 8 short dependent steps each)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sxm
    a = _rows_times_units(x_rows, rmask, wf_ptr, swf, units, umask, d, BM, BU, BK, "tf32")
    a = a.to(wf_ptr.dtype.element_ty).to(tl.float32)
    fires = (a > 0) & rmask[:, None] & umask[None, :]
    active = tl.max(fires.to(tl.int32), axis=0) > 0
    n_active = tl.sum(active.to(tl.int32), axis=0)
    slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
    ss = tl.arange(0, NA)
    if MODE == 4:
        tl.store(dbg_ptr + b, n_active.to(tl.float32))
        n_active = 0
    for g0 in range(0, n_active, NA):
        sel = (slot[None, :] == (g0 + ss)[:, None]) & active[None, :]  # [NA, BU]: slot s holds unit u
        uid = tl.sum(tl.where(sel, units[None, :], 0), axis=1)  # [NA]
        valid = (g0 + ss) < n_active
        # the group's gate values: one nonzero term per output, exact in an fp32 (ieee) product
        a_c = tl.dot(a, tl.trans(sel.to(tl.float32)), input_precision="ieee")  # [BM, NA]
        fires_c = (a_c > 0) & valid[None, :]
        u = tl.zeros([BM, NA], dtype=tl.float32)
        if MODE == 1:
            u += 1.0
        else:
            for k0 in tl.range(0, d, BKU, num_stages=SU):
                kk = k0 + tl.arange(0, BKU)
                xa = tl.load(x_rows + kk[None, :], mask=rmask[:, None], other=0.0)
                w = tl.load(wu_ptr + uid.to(tl.int64)[None, :] * swu + kk[:, None], mask=valid[None, :], other=0.0)
                u = tl.dot(xa, w, u)
        h = tl.where(fires_c, a_c, 0.0) * u.to(wu_ptr.dtype.element_ty).to(tl.float32)
        if MODE == 2:
            tl.store(dbg_ptr + b, tl.sum(tl.sum(h, axis=1), axis=0))
        else:
            _compact_down(h, uid, valid, fires_c, rows, wd_ptr, swd, acc_ptr, d, BD, SU, MODE)


@triton.jit
def _compact_down(h, uid, valid, fires_c, rows, wd_ptr, swd, acc_ptr, d, BD: tl.constexpr, SU: tl.constexpr,
                  MODE: tl.constexpr):
    hb = h.to(wd_ptr.dtype.element_ty)
    rowact = tl.sum(fires_c.to(tl.int32), axis=1) > 0
    for d0 in tl.range(0, d, BD, num_stages=SU):
        cols = d0 + tl.arange(0, BD)
        w = tl.load(wd_ptr + uid.to(tl.int64)[:, None] * swd + cols[None, :], mask=valid[:, None], other=0.0)
        part = tl.dot(hb, w)
        if MODE == 3:
            tl.store(acc_ptr + rows[:, None] * d + cols[None, :], part, mask=rowact[:, None])
        else:
            tl.atomic_add(acc_ptr + rows[:, None] * d + cols[None, :], part, mask=rowact[:, None], sem="relaxed")


@triton.jit
def _fused_merged_kernel(x_ptr, sxm, wf_ptr, swf, wu_ptr, swu, wd_ptr, swd, acc_ptr, M, d, f,
                         BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, NA: tl.constexpr, DH: tl.constexpr,
                         GDC: tl.constexpr):
    # the shipped kernel's gate; then a group of NA active units has its up rows and down rows
    # loaded at once (whole rows, d <= 2 DH, in two halves: one round of loads, not two) and both
    # products on CUDA cores per token row with an active unit (tensor-core dots would stage
    # every operand in shared memory: 460 KB in the first try)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    x_rows = x_ptr + rows.to(tl.int64)[:, None] * sxm
    a = _rows_times_units(x_rows, rmask, wf_ptr, swf, units, umask, d, BM, BU, BK, "tf32")
    a = a.to(wf_ptr.dtype.element_ty).to(tl.float32)
    fires = (a > 0) & rmask[:, None] & umask[None, :]
    active = tl.max(fires.to(tl.int32), axis=0) > 0
    n_active = tl.sum(active.to(tl.int32), axis=0)
    slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
    ss = tl.arange(0, NA)
    c0 = tl.arange(0, DH)
    c1 = DH + c0
    m0 = c0 < d
    m1 = c1 < d
    for g0 in range(0, n_active, NA):
        sel = (slot[None, :] == (g0 + ss)[:, None]) & active[None, :]  # [NA, BU]
        uid = tl.sum(tl.where(sel, units[None, :], 0), axis=1)
        valid = (g0 + ss) < n_active
        ur = wu_ptr + uid.to(tl.int64)[:, None] * swu
        dr = wd_ptr + uid.to(tl.int64)[:, None] * swd
        wu0 = tl.load(ur + c0[None, :], mask=valid[:, None] & m0[None, :], other=0.0)
        wu1 = tl.load(ur + c1[None, :], mask=valid[:, None] & m1[None, :], other=0.0)
        wd0 = tl.load(dr + c0[None, :], mask=valid[:, None] & m0[None, :], other=0.0)
        wd1 = tl.load(dr + c1[None, :], mask=valid[:, None] & m1[None, :], other=0.0)
        a_c = tl.sum(tl.where(sel[None, :, :], a[:, None, :], 0.0), axis=2)  # [BM, NA]: one term each
        fires_c = (a_c > 0) & valid[None, :]
        rowact = tl.sum(fires_c.to(tl.int32), axis=1)
        for m in tl.static_range(BM):
            if tl.sum(tl.where(rows == m, rowact, 0), axis=0) > 0:
                xm0 = tl.load(x_ptr + m * sxm + c0, mask=m0, other=0.0).to(tl.float32)
                xm1 = tl.load(x_ptr + m * sxm + c1, mask=m1, other=0.0).to(tl.float32)
                um = tl.sum(wu0.to(tl.float32) * xm0[None, :], axis=1) + tl.sum(wu1.to(tl.float32) * xm1[None, :], axis=1)
                am = tl.sum(tl.where(rows[:, None] == m, a_c, 0.0), axis=0)
                hm = tl.where((am > 0) & valid, am, 0.0) * um.to(wu_ptr.dtype.element_ty).to(tl.float32)
                hm = hm.to(wd_ptr.dtype.element_ty).to(tl.float32)
                y0 = tl.sum(hm[:, None] * wd0.to(tl.float32), axis=0)
                tl.atomic_add(acc_ptr + m * d + c0, y0, mask=m0, sem="relaxed")
                y1 = tl.sum(hm[:, None] * wd1.to(tl.float32), axis=0)
                tl.atomic_add(acc_ptr + m * d + c1, y1, mask=m1, sem="relaxed")


@triton.jit
def _split_gate_kernel(x_ptr, sxm, wf_ptr, swf, at_ptr, uid_ptr, cnt_ptr, M, d, f,
                       BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr):
    # first of three launches: the gate with units as the dot's rows, then the block's active units
    # appended to a list (one atomic ticket per block) with their rounded, relu'd gate values
    # a^T[slot, tokens] (bf16)
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    ks = tl.arange(0, BK)
    acc = tl.zeros([BU, BM], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        w = tl.load(wf_ptr + units.to(tl.int64)[:, None] * swf + kk[None, :], mask=umask[:, None] & (kk < d)[None, :], other=0.0)
        xt = tl.load(x_ptr + rows[None, :] * sxm + kk[:, None], mask=rmask[None, :] & (kk < d)[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    a = acc.to(wf_ptr.dtype.element_ty).to(tl.float32)
    fires = (a > 0) & umask[:, None] & rmask[None, :]
    active = tl.max(fires.to(tl.int32), axis=1) > 0
    n = tl.sum(active.to(tl.int32), axis=0)
    if n > 0:
        base = tl.atomic_add(cnt_ptr, n)
        slot = base + tl.cumsum(active.to(tl.int32), axis=0) - 1
        tl.store(uid_ptr + slot, units, mask=active)
        tl.store(at_ptr + slot.to(tl.int64)[:, None] * BM + rows[None, :], tl.where(fires, a, 0.0).to(at_ptr.dtype.element_ty),
                 mask=active[:, None])


@triton.jit
def _split_updown_kernel(x_ptr, sxm, wu_ptr, swu, wd_ptr, swd, at_ptr, uid_ptr, cnt_ptr, acc_ptr, M, d, P,
                         BM: tl.constexpr, BD: tl.constexpr, GDC: tl.constexpr):
    # second launch: P programs walk the list of active units; for each, the up row times the
    # x rows of the tokens it fires for (CUDA cores: other rows are never read), then its down
    # row scaled by h added into those tokens' rows of acc (fp32 atomics)
    if GDC:
        tl.extra.cuda.gdc_wait()  # the gate launch has completed and its list is visible
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n = tl.load(cnt_ptr)
    rows = tl.arange(0, BM)
    rmask = rows < M
    cs = tl.arange(0, BD)
    for i in range(pid, n, P):
        j = tl.load(uid_ptr + i).to(tl.int64)
        av = tl.load(at_ptr + i * BM + rows, mask=rmask, other=0.0).to(tl.float32)
        fire = av > 0
        u = tl.zeros([BM], dtype=tl.float32)
        for c0 in range(0, d, BD):
            cols = c0 + cs
            cm = cols < d
            w = tl.load(wu_ptr + j * swu + cols, mask=cm, other=0.0).to(tl.float32)
            xt = tl.load(x_ptr + rows[:, None] * sxm + cols[None, :], mask=fire[:, None] & cm[None, :], other=0.0).to(tl.float32)
            u += tl.sum(xt * w[None, :], axis=1)
        h = tl.where(fire, av, 0.0) * u.to(wu_ptr.dtype.element_ty).to(tl.float32)
        h = h.to(wd_ptr.dtype.element_ty).to(tl.float32)
        for c0 in range(0, d, BD):
            cols = c0 + cs
            cm = cols < d
            wdv = tl.load(wd_ptr + j * swd + cols, mask=cm, other=0.0).to(tl.float32)
            tl.atomic_add(acc_ptr + rows[:, None] * d + cols[None, :], h[:, None] * wdv[None, :], mask=fire[:, None] & cm[None, :],
                          sem="relaxed")


@triton.jit
def _split_write_out_kernel(acc_ptr, y_ptr, stride_ym, cnt_ptr, M, d, BLOCK: tl.constexpr, GDC: tl.constexpr):
    # third launch: y = acc rounded, acc zeroed and the list emptied for the next call
    if GDC:
        tl.extra.cuda.gdc_wait()
    m = tl.program_id(1)
    c = tl.program_id(0)
    cols = c * BLOCK + tl.arange(0, BLOCK)
    mask = cols < d
    v = tl.load(acc_ptr + m * d + cols, mask=mask, other=0.0)
    tl.store(y_ptr + m.to(tl.int64) * stride_ym + cols, v.to(y_ptr.dtype.element_ty), mask=mask)
    tl.store(acc_ptr + m * d + cols, tl.zeros([BLOCK], dtype=tl.float32), mask=mask)
    if (m == 0) & (c == 0):
        tl.store(cnt_ptr, 0)


@triton.jit
def _fire_gate_kernel(x_ptr, sxm, wf_ptr, swf, fu_ptr, fm_ptr, fa_ptr, cnt_ptr, M, d, f,
                      BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, GDC: tl.constexpr):
    # as _split_gate_kernel, but the list holds one entry per fire: (unit, token, gate value), so
    # the next launch works per firing token, not per unit times a tile of BM tokens
    if GDC:
        tl.extra.cuda.gdc_launch_dependents()
    b = tl.program_id(0)
    rows = tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    ks = tl.arange(0, BK)
    acc = tl.zeros([BU, BM], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        w = tl.load(wf_ptr + units.to(tl.int64)[:, None] * swf + kk[None, :], mask=umask[:, None] & (kk < d)[None, :], other=0.0)
        xt = tl.load(x_ptr + rows[None, :] * sxm + kk[:, None], mask=rmask[None, :] & (kk < d)[:, None], other=0.0)
        acc = tl.dot(w, xt, acc)
    a = acc.to(wf_ptr.dtype.element_ty).to(tl.float32)
    fires = (a > 0) & umask[:, None] & rmask[None, :]
    n = tl.sum(tl.sum(fires.to(tl.int32), axis=1), axis=0)
    if n > 0:
        base = tl.atomic_add(cnt_ptr, n)
        flat = tl.reshape(fires.to(tl.int32), [BU * BM])
        slot = base + tl.cumsum(flat, axis=0) - 1
        ok = flat > 0
        uu = tl.reshape(units[:, None] + rows[None, :] * 0, [BU * BM])
        mm = tl.reshape(units[:, None] * 0 + rows[None, :], [BU * BM])
        tl.store(fu_ptr + slot, uu, mask=ok)
        tl.store(fm_ptr + slot, mm, mask=ok)
        tl.store(fa_ptr + slot, tl.reshape(a, [BU * BM]), mask=ok)


@triton.jit
def _fire_updown_kernel(x_ptr, sxm, wu_ptr, swu, wd_ptr, swd, fu_ptr, fm_ptr, fa_ptr, cnt_ptr, acc_ptr, d, P,
                        BD: tl.constexpr, GDC: tl.constexpr):
    # P programs walk the fires: h = a * (x[m] . w_up[u]), then acc[m] += h w_down[u] (fp32 atomics).
    # When one step covers d (BD >= d), the up row, the x row and the down row are loaded together:
    # one round of loads per fire instead of two (the phases are bound by rounds, not bytes)
    if GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()
    pid = tl.program_id(0)
    n = tl.load(cnt_ptr)
    cs = tl.arange(0, BD)
    cm1 = cs < d
    for i in range(pid, n, P):
        j = tl.load(fu_ptr + i).to(tl.int64)
        m = tl.load(fm_ptr + i).to(tl.int64)
        av = tl.load(fa_ptr + i)
        if BD >= d:
            w = tl.load(wu_ptr + j * swu + cs, mask=cm1, other=0.0).to(tl.float32)
            xv = tl.load(x_ptr + m * sxm + cs, mask=cm1, other=0.0).to(tl.float32)
            wdv = tl.load(wd_ptr + j * swd + cs, mask=cm1, other=0.0).to(tl.float32)
            us = tl.sum(w * xv, axis=0).to(wu_ptr.dtype.element_ty).to(tl.float32)
            h = (av * us).to(wd_ptr.dtype.element_ty).to(tl.float32)
            tl.atomic_add(acc_ptr + m * d + cs, h * wdv, mask=cm1, sem="relaxed")
        else:
            u = tl.zeros([BD], dtype=tl.float32)
            for c0 in range(0, d, BD):
                cols = c0 + cs
                cm = cols < d
                w = tl.load(wu_ptr + j * swu + cols, mask=cm, other=0.0).to(tl.float32)
                xv = tl.load(x_ptr + m * sxm + cols, mask=cm, other=0.0).to(tl.float32)
                u += w * xv
            us = tl.sum(u, axis=0).to(wu_ptr.dtype.element_ty).to(tl.float32)
            h = (av * us).to(wd_ptr.dtype.element_ty).to(tl.float32)
            for c0 in range(0, d, BD):
                cols = c0 + cs
                cm = cols < d
                wdv = tl.load(wd_ptr + j * swd + cols, mask=cm, other=0.0).to(tl.float32)
                tl.atomic_add(acc_ptr + m * d + cols, h * wdv, mask=cm, sem="relaxed")


# (programs of the second launch, its warps, BD)
FIRE = [(1056, 4, 2048), (2112, 4, 2048), (528, 4, 2048)]


MS_SPLIT = (1, 8, 16, 32, 64, 256) if "--fire" in sys.argv else (1, 4, 8, 16, 32, 64)
# (programs of the second launch, its warps, BD as a multiple of 8192 / BM)
SPLIT = [(528, 4, 1), (1056, 4, 1), (264, 4, 1), (528, 2, 1), (528, 4, 2), (1056, 2, 1)]


# (BU, BK, warps, stages, NA)
MERGED = [(64, 256, 8, 3, 8), (64, 256, 8, 3, 4), (32, 256, 4, 3, 8), (64, 256, 8, 3, 16), (32, 256, 8, 3, 4)]


# (BU, BK, warps, stages, NA, BKU, BD, SU)
COMPACT = [(64, 256, 8, 3, 16, 1024, 1024, 2), (64, 256, 8, 3, 16, 512, 512, 2), (64, 256, 8, 3, 16, 2048, 2048, 1),
           (64, 256, 8, 3, 32, 512, 512, 2), (64, 256, 4, 4, 16, 1024, 1024, 2), (64, 256, 8, 3, 16, 1024, 512, 2),
           (32, 256, 4, 3, 16, 1024, 1024, 2), (64, 256, 8, 3, 16, 256, 256, 3)]


# (BU, BK, BD, warps, stages)
FUSED_WX = [(64, 256, 128, 4, 3), (64, 128, 128, 4, 4), (64, 256, 256, 4, 3), (128, 128, 128, 8, 3),
            (64, 256, 64, 4, 3), (64, 512, 128, 4, 2), (128, 256, 128, 8, 2)]


# (BU, BK, warps, stages)
XW = [(16, 256, 4, 3), (32, 256, 4, 3), (64, 256, 8, 3), (64, 256, 4, 4), (32, 512, 4, 3), (16, 512, 4, 4),
      (16, 2048, 4, 1), (32, 128, 4, 6), (16, 128, 2, 6), (32, 1024, 4, 1)]
# (BU, BK, warps, stages, S)
WX = [(64, 128, 4, 4, 1), (64, 256, 4, 3, 1), (64, 256, 4, 4, 1), (64, 512, 4, 2, 1), (128, 128, 8, 4, 1),
      (128, 256, 8, 3, 1), (64, 128, 4, 6, 1), (64, 1024, 4, 1, 1), (64, 256, 4, 3, 2), (64, 256, 4, 3, 4),
      (64, 256, 4, 2, 8), (64, 128, 4, 4, 4), (64, 128, 4, 2, 16), (128, 256, 8, 2, 8)]
if "--compact" in sys.argv:  # the second call: the compacted kernel against the shipped one only
    XW, WX, FUSED_WX = [], [], []
if SMOKE:
    XW, WX = [(16, 32, 4, 1)], [(16, 32, 4, 1, 1), (16, 16, 4, 1, 2)]
    FUSED_WX = [(16, 32, 16, 4, 1)]
    COMPACT = [(16, 32, 4, 1, 16, 32, 32, 1), (32, 16, 4, 1, 16, 64, 16, 1)]


def graph_us(fn) -> float:
    if SMOKE:
        fn()
        return 0.0
    from twell.bench.timing import graph_ms

    return 1e3 * graph_ms(fn)


def main() -> None:
    from twell.bench.inference import dense_gated, errors, reference_fp32
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

    torch.manual_seed(0)
    records = []
    gate_mb = F * D * 2 / 1e6
    for M in MS:
        ffn = make_ffn(M, D, F, 29, "even", DTYPE, DEVICE)
        x, wg, wu, wd = ffn.x, ffn.w_gate, ffn.w_up, ffn.w_down
        wdt = wd.t().contiguous()
        ref = (x.float() @ wg.float().t())
        out = torch.empty(M, F, dtype=DTYPE, device=DEVICE)
        BM = max(16, triton.next_power_of_2(M))
        sc = DecodeScratch(D, x.device)

        def rec(name, us, err=None):
            # err: the gate products' relative error; for the whole-FFN variants (fwx, cmp), the
            # worst row's error against fp32 (the calls of 2026-12-01 stored both as "rel_err")
            r = {"M": M, "variant": name, "us": us, "gate_TBps": gate_mb / us if us else None, "err": err}
            records.append(r)
            print(f"M {M:3d} {name:28s} {us:8.2f} us" + (f"  err {err:.1e}" if err is not None else ""), flush=True)

        if not SMOKE:
            rec("dense_mlp", graph_us(lambda: dense_gated(x, wg, wu, wd)))
            rec("cublas_gate", graph_us(lambda: torch.mm(x, wg.t(), out=out)))
            if M <= 64:
                rec("fused_shipped_k29", graph_us(lambda: ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=sc if M <= 16 else None)))
                x0 = torch.zeros_like(x)
                rec("fused_shipped_x0", graph_us(lambda: ffn_decode_fused(x0, wg, wdt, w_up=wu, scratch=sc if M <= 16 else None)))
        for k in ((8, 29, 56) if M in (16, 64) else (29,)):
            fk = make_ffn(M, D, F, k, "even", DTYPE, DEVICE)
            xk = fk.x
            refy = reference_fp32(xk, wg, wu, wd)
            if not SMOKE and k != 29:
                rec(f"fused_shipped_k{k}", graph_us(lambda: ffn_decode_fused(xk, wg, wdt, w_up=wu, scratch=sc if M <= 16 else None)))
            for BU, BK, nw, ns, NA, BKU, BD, SU in COMPACT:
                name = f"cmp_k{k}_{BU}x{BK}w{nw}s{ns}_na{NA}x{BKU}x{BD}s{SU}"
                try:
                    def fn():
                        use_sc = M <= 16
                        gdc = use_sc and pdl_ok(xk)
                        a_ = sc.acc if use_sc else torch.zeros(M, D, dtype=torch.float32, device=DEVICE)
                        _fused_compact_kernel[(triton.cdiv(F, BU),)](
                            xk, xk.stride(0), wg, wg.stride(0), wu, wu.stride(0), wdt, wdt.stride(0), a_, M, D, F,
                            BM=BM, BU=BU, BK=min(BK, D), NA=NA, BKU=min(BKU, D), BD=min(BD, D), SU=SU, GDC=gdc,
                            num_warps=nw, num_stages=ns)
                        if not use_sc:
                            return a_.to(DTYPE)
                        y = torch.empty(M, D, dtype=DTYPE, device=DEVICE)
                        WB = min(1024, triton.next_power_of_2(D))
                        _write_out_kernel[(triton.cdiv(D, WB), M)](a_, y, y.stride(0), M, D, BLOCK=WB, GDC=gdc, num_warps=4,
                                                                   launch_pdl=gdc)
                        return y
                    y = fn()
                    err = errors(y, refy)
                    rec(name, graph_us(fn), err[1])
                except Exception as e:  # noqa: BLE001
                    records.append({"M": M, "variant": name, "error": repr(e)[:300]})
                    print(f"M {M:3d} {name:28s} failed: {repr(e)[:120]}", flush=True)
            acc = torch.zeros(M, D, dtype=torch.float32, device=DEVICE)
            for BU, BK, BD, nw, ns in FUSED_WX:
                name = f"fwx_k{k}_{BU}x{BK}x{BD}_w{nw}s{ns}"
                try:
                    def fn():
                        acc.zero_()
                        _fused_wx_kernel[(triton.cdiv(F, BU),)](xk, xk.stride(0), wg, wg.stride(0), wu, wu.stride(0), wdt,
                                                                wdt.stride(0), acc, M, D, F, BM=BM, BU=BU, BK=min(BK, D),
                                                                BD=min(BD, D), num_warps=nw, num_stages=ns)
                        return acc.to(DTYPE)
                    y = fn()
                    err = errors(y, refy)
                    rec(name, graph_us(fn), err[1])
                except Exception as e:  # noqa: BLE001
                    records.append({"M": M, "variant": name, "error": repr(e)[:300]})
                    print(f"M {M:3d} {name:28s} failed: {repr(e)[:120]}", flush=True)
        for BU, BK, nw, ns in XW:
            name = f"xw_{BU}x{BK}_w{nw}s{ns}"
            try:
                fn = lambda: _gate_xw_kernel[(triton.cdiv(F, BU),)](x, x.stride(0), wg, wg.stride(0), out, M, D, F,
                                                                   BM=BM, BU=BU, BK=min(BK, D), num_warps=nw, num_stages=ns)
                out.fill_(float("nan"))
                fn()
                err = float((out.float() - ref).norm() / ref.norm())
                rec(name, graph_us(fn), err)
            except Exception as e:  # noqa: BLE001 (a shape that does not compile: recorded)
                records.append({"M": M, "variant": name, "error": repr(e)[:300]})
                print(f"M {M:3d} {name:28s} failed: {repr(e)[:120]}", flush=True)
        for BU, BK, nw, ns, S in WX:
            name = f"wx_{BU}x{BK}_w{nw}s{ns}_S{S}"
            part = torch.empty(S, M, F, dtype=torch.float32, device=DEVICE)
            try:
                fn = lambda: _gate_wx_kernel[(triton.cdiv(F, BU), S)](x, x.stride(0), wg, wg.stride(0), out, part, M, D, F,
                                                                      BM=BM, BU=BU, BK=min(BK, D // S), S=S, num_warps=nw,
                                                                      num_stages=ns)
                out.fill_(float("nan"))
                part.fill_(float("nan"))
                fn()
                got = out.float() if S == 1 else part.sum(0)
                err = float((got - ref).norm() / ref.norm())
                rec(name, graph_us(fn), err)
            except Exception as e:  # noqa: BLE001
                records.append({"M": M, "variant": name, "error": repr(e)[:300]})
                print(f"M {M:3d} {name:28s} failed: {repr(e)[:120]}", flush=True)
    meta = {"gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu", "torch": torch.__version__,
            "triton": triton.__version__, "d": D, "f": F, "dtype": str(DTYPE)}
    with open(os.path.join(OUT, "decode_gate_probe.json"), "w") as fh:
        json.dump({"meta": meta, "records": records}, fh, indent=1)
    print("\nbest per M (us, gate TB/s):")
    for M in MS:
        rs = [r for r in records if r["M"] == M and r.get("us")]
        for fam in ("dense_mlp", "cublas_gate", "fused_shipped_k8", "fused_shipped_k29", "fused_shipped_k56", "fused_shipped_x0",
                    "fwx_k8", "fwx_k29", "fwx_k56", "cmp_k8", "cmp_k29", "cmp_k56", "xw_", "wx_"):
            c = [r for r in rs if r["variant"].startswith(fam)]
            if c:
                b = min(c, key=lambda r: r["us"])
                print(f"M {M:3d} {fam:18s} {b['variant']:30s} {b['us']:7.2f} us {b['gate_TBps']:.2f} TB/s")


def decompose() -> None:
    """Where the ~12 us between the shipped kernel on x = 0 and on real inputs go: the compacted
    kernel at its best shape of the second call, each part switched off in turn (MODE), with the
    kept accumulator and PDL write-out and without (zeroed buffer, cast)."""
    from twell.bench.inference import dense_gated
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

    records = []
    BU, BK, nw, ns, NA, BKU, BD, SU = (64, 256, 4, 4, 16, 1024, 1024, 2) if not SMOKE else (16, 32, 4, 1, 16, 32, 32, 1)
    # 8 and 16 tokens: at 64 this shape needs 344 KB of shared memory (the third call stopped there)
    for M in ((16,) if SMOKE else (8, 16)):
        for k in (8, 29):
            fk = make_ffn(M, D, F, k, "even", DTYPE, DEVICE)
            x, wg, wu, wd = fk.x, fk.w_gate, fk.w_up, fk.w_down
            wdt = wd.t().contiguous()
            sc = DecodeScratch(D, x.device)
            dbg = torch.zeros(F, dtype=torch.float32, device=DEVICE)
            BM = max(16, triton.next_power_of_2(M))

            def rec(name, us):
                records.append({"M": M, "k": k, "variant": name, "us": us})
                print(f"M {M:3d} k {k:2d} {name:34s} {us:8.2f} us", flush=True)

            rec("dense_mlp", graph_us(lambda: dense_gated(x, wg, wu, wd)))
            use = sc if M <= 16 else None
            rec("shipped", graph_us(lambda: ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=use)))
            rec("shipped_nongated", graph_us(lambda: ffn_decode_fused(x, wg, wdt, scratch=use)))
            x0 = torch.zeros_like(x)
            rec("shipped_x0", graph_us(lambda: ffn_decode_fused(x0, wg, wdt, w_up=wu, scratch=use)))
            for xin, xname in ((x, ""), (x0, "_x0")):
                for mode in (0, 1, 2, 3, 4):
                    if xname and mode:
                        continue
                    for pdl in ((True, False) if M <= 16 else (False,)):
                        def fn():
                            gdc = pdl and pdl_ok(xin)
                            a_ = sc.acc if pdl else torch.zeros(M, D, dtype=torch.float32, device=DEVICE)
                            _fused_compact_kernel[(triton.cdiv(F, BU),)](
                                xin, xin.stride(0), wg, wg.stride(0), wu, wu.stride(0), wdt, wdt.stride(0), a_, M, D, F,
                                BM=BM, BU=BU, BK=min(BK, D), NA=NA, BKU=min(BKU, D), BD=min(BD, D), SU=SU, GDC=gdc,
                                MODE=mode, dbg_ptr=dbg, num_warps=nw, num_stages=ns)
                            if not pdl:
                                return a_.to(DTYPE)
                            y = torch.empty(M, D, dtype=DTYPE, device=DEVICE)
                            WB = min(1024, triton.next_power_of_2(D))
                            _write_out_kernel[(triton.cdiv(D, WB), M)](a_, y, y.stride(0), M, D, BLOCK=WB, GDC=gdc,
                                                                       num_warps=4, launch_pdl=gdc)
                            return y
                        rec(f"cmp_mode{mode}{xname}_{'pdl' if pdl else 'plain'}", graph_us(fn))
    with open(os.path.join(OUT, "decode_gate_decompose.json"), "w") as fh:
        json.dump({"records": records}, fh, indent=1)



def chain() -> None:
    """Per-layer time when L layers with distinct weights run back to back in one CUDA graph (L2
    flushed once before the replay): the first call pays the cold start the one-call timing
    sees (instruction fetch and first accesses after the flush); later layers see what a
    model's layers see, weights still from HBM (L x 69 MB >> L2)."""
    from twell.bench.inference import dense_gated
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

    records = []
    LAYERS = 1 if SMOKE else 8
    for M in ((16,) if SMOKE else (1, 4, 16, 64)):
        layers = []
        for i in range(LAYERS):
            fk = make_ffn(M, D, F, 29, "even", DTYPE, DEVICE, seed=i)
            layers.append((fk.x, fk.w_gate, fk.w_up, fk.w_down, fk.w_down.t().contiguous(), DecodeScratch(D, fk.x.device)))
        for L in ((1,) if SMOKE else (1, 2, 4, 8)):
            def dense():
                for x, wg, wu, wd, _, _ in layers[:L]:
                    dense_gated(x, wg, wu, wd)

            def twell():
                for x, wg, wu, _, wdt, sc in layers[:L]:
                    ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=sc if M <= 16 else None)
            dus, tus = graph_us(dense), graph_us(twell)
            records.append({"M": M, "layers": L, "dense_us": dus, "twell_us": tus})
            print(f"M {M:3d} layers {L}: dense {dus:7.2f} us ({dus / L:6.2f}/layer)  twell {tus:7.2f} us "
                  f"({tus / L:6.2f}/layer)  speedup {dus / tus if tus else 0:.2f}x", flush=True)
    with open(os.path.join(OUT, "decode_gate_chain.json"), "w") as fh:
        json.dump({"records": records}, fh, indent=1)



def merged() -> None:
    """The merged kernel (up and down rows loaded in one round) against the shipped and the best
    compacted kernel of the second call, at 8 and 16 tokens (two-half rows: d <= 2 DH)."""
    from twell.bench.inference import dense_gated, errors, reference_fp32
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

    records = []
    cfgs = MERGED if not SMOKE else [(16, 32, 4, 1, 8), (32, 16, 4, 1, 4)]
    for M in ((16,) if SMOKE else (6, 8, 16)):
        for k in (8, 29, 56):
            fk = make_ffn(M, D, F, k, "even", DTYPE, DEVICE)
            x, wg, wu, wd = fk.x, fk.w_gate, fk.w_up, fk.w_down
            wdt = wd.t().contiguous()
            sc = DecodeScratch(D, x.device)
            refy = reference_fp32(x, wg, wu, wd)
            BM = max(16, triton.next_power_of_2(M))

            def rec(name, us, err=None):
                records.append({"M": M, "k": k, "variant": name, "us": us, "max_row_err": err})
                print(f"M {M:3d} k {k:2d} {name:34s} {us:8.2f} us" + (f"  row err {err:.1e}" if err is not None else ""),
                      flush=True)

            dense_row = errors(dense_gated(x, wg, wu, wd), refy)[1]
            rec("dense_mlp", graph_us(lambda: dense_gated(x, wg, wu, wd)), dense_row)
            rec("shipped", graph_us(lambda: ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=sc)))
            for BU, BK, nw, ns, NA in cfgs:
                def fn():
                    gdc = pdl_ok(x)
                    _fused_merged_kernel[(triton.cdiv(F, BU),)](
                        x, x.stride(0), wg, wg.stride(0), wu, wu.stride(0), wdt, wdt.stride(0), sc.acc, M, D, F,
                        BM=BM, BU=BU, BK=min(BK, D), NA=NA, DH=max(16, triton.next_power_of_2(D) // 2), GDC=gdc,
                        num_warps=nw, num_stages=ns)
                    y = torch.empty(M, D, dtype=DTYPE, device=DEVICE)
                    WB = min(1024, triton.next_power_of_2(D))
                    _write_out_kernel[(triton.cdiv(D, WB), M)](sc.acc, y, y.stride(0), M, D, BLOCK=WB, GDC=gdc,
                                                               num_warps=4, launch_pdl=gdc)
                    return y
                name = f"merged_{BU}x{BK}w{nw}s{ns}_na{NA}"
                try:
                    err = errors(fn(), refy)[1]
                    rec(name, graph_us(fn), err)
                except Exception as e:  # noqa: BLE001
                    records.append({"M": M, "k": k, "variant": name, "error": repr(e)[:300]})
                    print(f"M {M:3d} {name:28s} failed: {repr(e)[:120]}", flush=True)
    with open(os.path.join(OUT, "decode_gate_merged.json"), "w") as fh:
        json.dump({"records": records}, fh, indent=1)



def configs() -> None:
    """The shipped kernel at other (BU, BK, BD, warps, stages): the compacted kernel's best shape
    of the second call had 4 warps and 4 stages where the shipped one has 8 and 3; is its gain
    the compaction or the shape?"""
    from twell.bench.inference import dense_gated
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fused import FUSED_CONFIG, DecodeScratch, ffn_decode_fused

    records = []
    shapes = [FUSED_CONFIG, (64, 256, 256, 4, 4), (64, 256, 256, 4, 3), (64, 256, 128, 4, 4), (64, 256, 256, 8, 4),
              (64, 128, 256, 4, 6)] if not SMOKE else [(16, 32, 32, 4, 1)]
    for M in ((16,) if SMOKE else (6, 8, 16, 32)):
        for k in (8, 29, 56):
            fk = make_ffn(M, D, F, k, "even", DTYPE, DEVICE)
            x, wg, wu, wd = fk.x, fk.w_gate, fk.w_up, fk.w_down
            wdt = wd.t().contiguous()
            sc = DecodeScratch(D, x.device)
            dus = graph_us(lambda: dense_gated(x, wg, wu, wd))
            line = f"M {M:3d} k {k:2d} dense {dus:6.2f}"
            for c in shapes:
                try:
                    us = graph_us(lambda: ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=sc, config=c))
                except Exception as e:  # noqa: BLE001 (shared memory: recorded)
                    records.append({"M": M, "k": k, "config": list(c), "error": repr(e)[:200]})
                    line += f" | {'x'.join(map(str, c))} failed"
                    continue
                records.append({"M": M, "k": k, "config": list(c), "us": us, "dense_us": dus})
                line += f" | {'x'.join(map(str, c))} {us:6.2f}"
            print(line, flush=True)
    with open(os.path.join(OUT, "decode_gate_configs.json"), "w") as fh:
        json.dump({"records": records}, fh, indent=1)



def split() -> None:
    """Three launches, each a programmatic dependent launch of the one before: the gate
    (units as the dot's rows) appending active units to a list; P programs doing each listed
    unit's up and down on CUDA cores for the tokens it fires for; the write-out. Against dense
    and the shipped kernels (kept accumulator), 1 to 64 tokens, k 8 / 29 / 56 even and 29 skewed."""
    from twell.bench.inference import dense_gated, errors, reference_fp32
    from twell.bench.synthetic import make_ffn
    from twell.kernels.decode_fused import DecodeScratch, ffn_decode_fused

    records = []
    cfgs = SPLIT if not SMOKE else [(7, 4, 1), (3, 2, 2)]
    if "--fire" in sys.argv:  # the per-fire variant only (beside dense and the shipped kernels)
        cfgs = []
    cases = [(8, "even"), (29, "even"), (56, "even"), (29, "skewed")] if not SMOKE else [(29, "even"), (29, "skewed")]
    for M in ((3, 16) if SMOKE else MS_SPLIT):
        BM = max(16, triton.next_power_of_2(M))
        at = torch.empty(F, BM, dtype=DTYPE, device=DEVICE)
        uid = torch.empty(F, dtype=torch.int32, device=DEVICE)
        cnt = torch.zeros(1, dtype=torch.int32, device=DEVICE)
        acc = torch.zeros(M, D, dtype=torch.float32, device=DEVICE)
        fu = torch.empty(M * F, dtype=torch.int32, device=DEVICE)  # one entry per fire: at most M f
        fm = torch.empty(M * F, dtype=torch.int32, device=DEVICE)
        fa = torch.empty(M * F, dtype=torch.float32, device=DEVICE)
        for k, dist in cases:
            fk = make_ffn(M, D, F, k, dist, DTYPE, DEVICE)
            x, wg, wu, wd = fk.x, fk.w_gate, fk.w_up, fk.w_down
            wdt = wd.t().contiguous()
            sc = DecodeScratch(D, x.device)
            refy = reference_fp32(x, wg, wu, wd)
            union = int(((x.float() @ wg.float().t()) > 0).any(0).sum())

            def rec(name, us, err=None):
                records.append({"M": M, "k": k, "distribution": dist, "union": union, "variant": name, "us": us,
                                "max_row_err": err})
                print(f"M {M:3d} k {k:2d} {dist:6s} union {union:5d} {name:24s} {us:8.2f} us"
                      + (f"  row err {err:.1e}" if err is not None else ""), flush=True)

            rec("dense_mlp", graph_us(lambda: dense_gated(x, wg, wu, wd)), errors(dense_gated(x, wg, wu, wd), refy)[1])
            if M <= 64:  # the fused kernels' range; above it the dispatcher runs dense, timed above
                rec("shipped", graph_us(lambda: ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=sc if M <= 16 else None)),
                    errors(ffn_decode_fused(x, wg, wdt, w_up=wu, scratch=sc if M <= 16 else None), refy)[1])
            else:
                rec("shipped", records[-1]["us"], records[-1]["max_row_err"])
            for P, nw2, bdx in cfgs:
                BD = min(max(16, triton.next_power_of_2(D)), max(16, bdx * 8192 // BM)) if not SMOKE else 16 * bdx

                def fn():
                    gdc = pdl_ok(x)
                    _split_gate_kernel[(triton.cdiv(F, 64 if not SMOKE else 16),)](
                        x, x.stride(0), wg, wg.stride(0), at, uid, cnt, M, D, F, BM=BM, BU=64 if not SMOKE else 16,
                        BK=128 if not SMOKE else 32, GDC=gdc, num_warps=4, num_stages=6 if not SMOKE else 1)
                    _split_updown_kernel[(P,)](x, x.stride(0), wu, wu.stride(0), wdt, wdt.stride(0), at, uid, cnt, acc, M, D, P,
                                               BM=BM, BD=BD, GDC=gdc, num_warps=nw2, launch_pdl=gdc)
                    y = torch.empty(M, D, dtype=DTYPE, device=DEVICE)
                    WB = min(1024, triton.next_power_of_2(D))
                    _split_write_out_kernel[(triton.cdiv(D, WB), M)](acc, y, y.stride(0), cnt, M, D, BLOCK=WB, GDC=gdc,
                                                                     num_warps=4, launch_pdl=gdc)
                    return y
                name = f"split_P{P}_w{nw2}_bd{BD}"
                try:
                    errs = [errors(fn(), refy)[1] for _ in range(3)]  # three calls: the list and acc reset each time
                    rec(name, graph_us(fn), max(errs))
                except Exception as e:  # noqa: BLE001
                    records.append({"M": M, "k": k, "variant": name, "error": repr(e)[:300]})
                    print(f"M {M:3d} {name:28s} failed: {repr(e)[:160]}", flush=True)
            for P, nw2, BD in (FIRE if not SMOKE else [(7, 4, 32), (3, 2, 16), (5, 4, 64)]):
                BD = min(BD, max(16, triton.next_power_of_2(D)))

                def fn():
                    gdc = pdl_ok(x)
                    _fire_gate_kernel[(triton.cdiv(F, 64 if not SMOKE else 16),)](
                        x, x.stride(0), wg, wg.stride(0), fu, fm, fa, cnt, M, D, F, BM=BM, BU=64 if not SMOKE else 16,
                        BK=128 if not SMOKE else 32, GDC=gdc, num_warps=4, num_stages=6 if not SMOKE else 1)
                    _fire_updown_kernel[(P,)](x, x.stride(0), wu, wu.stride(0), wdt, wdt.stride(0), fu, fm, fa, cnt, acc, D, P,
                                              BD=BD, GDC=gdc, num_warps=nw2, launch_pdl=gdc)
                    y = torch.empty(M, D, dtype=DTYPE, device=DEVICE)
                    WB = min(1024, triton.next_power_of_2(D))
                    _split_write_out_kernel[(triton.cdiv(D, WB), M)](acc, y, y.stride(0), cnt, M, D, BLOCK=WB, GDC=gdc,
                                                                     num_warps=4, launch_pdl=gdc)
                    return y
                name = f"fire_P{P}_w{nw2}_bd{BD}"
                try:
                    errs = [errors(fn(), refy)[1] for _ in range(3)]
                    rec(name, graph_us(fn), max(errs))
                except Exception as e:  # noqa: BLE001
                    records.append({"M": M, "k": k, "variant": name, "error": repr(e)[:300]})
                    print(f"M {M:3d} {name:28s} failed: {repr(e)[:160]}", flush=True)
    with open(os.path.join(OUT, "decode_gate_split.json"), "w") as fh:
        json.dump({"records": records}, fh, indent=1)
    print("\nbest split or fire variant against dense and shipped (us):")
    for M in sorted({r["M"] for r in records}):
        for k, dist in cases:
            rs = [r for r in records if r["M"] == M and r["k"] == k and r.get("distribution") == dist and r.get("us") is not None]
            sp = [r for r in rs if r["variant"].startswith(("split", "fire"))]
            if not sp:
                continue
            b = min(sp, key=lambda r: r["us"])
            dn = next(r for r in rs if r["variant"] == "dense_mlp")
            sh = next(r for r in rs if r["variant"] == "shipped")
            print(f"M {M:3d} k {k:2d} {dist:6s} dense {dn['us']:6.2f} shipped {sh['us']:6.2f} ({dn['us'] / max(sh['us'], 1e-9):.2f}x) "
                  f"split {b['us']:6.2f} ({dn['us'] / max(b['us'], 1e-9):.2f}x) {b['variant']} row err {b['max_row_err']:.1e}")


if __name__ == "__main__":
    try:
        split() if "--split" in sys.argv else configs() if "--configs" in sys.argv else merged() if "--merged" in sys.argv else chain() if "--chain" in sys.argv else decompose() if "--decompose" in sys.argv else main()
    except Exception:
        traceback.print_exc()
        sys.exit(1)
