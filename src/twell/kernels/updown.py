"""The FFN from TwELL: fused gated up/down, or the non-gated down projection.

For each token ``m`` and each active unit ``j`` of its TwELL row::

    gated:      h = g[m, j] * (x[m] . w_up[j]);   y[m] += h * w_down[:, j]
    non-gated:  h = h[m, j];                      y[m] += h * w_down[:, j]

One program per token. Its TwELL entries are compacted across tiles on the fly (a prefix sum
of the tile counts maps entry number ``e`` to its (tile, slot)), then processed ``BE`` at a
time: ``BE`` up rows and ``BE`` down columns gathered as ``[BE, d]`` blocks (the down columns
come as rows of ``w_down^T [f, d]``, so each is one contiguous 2*d-byte load), reduced in fp32.
``y[m]`` stays in registers until one final store: nothing ``[M, f]``-sized is written.

Exact path: a (row, tile) whose count exceeds the slots lost entries, so the program
processes the whole tile instead, ``BE`` units at a time, taking the gate (or the non-gated
pre-activation) either from the dense pre-activation ``pre`` when the caller has it (cuBLAS
gate: one cheap read) or recomputing it from ``x`` and ``w_first`` (fused gate kernel). Inactive
units of such a tile cost arithmetic but no memory traffic (their loads are masked off). From
``TWO_PASS_MIN_M`` tokens on, the exact path runs in a second launch with wider programs, so an
overflowed row does not become the serial tail of the narrow, tuned first launch; or, when the
caller lets ``pre`` be overwritten (``pre_writable``: the modules and the ops), the rows with an
overflowed tile or more than ``DENSE_ROW_MIN`` active units are listed on the device and
computed whole, as the dense MLP computes them, on tensor cores over blocks of listed rows
(:mod:`.heavy_rows`), the first launch leaving them out.
Every overflowed tile and every row with one is counted in :class:`OverflowCounters`, on the
device, with no host synchronisation.

Weight layout: ``w_up`` and ``w_down_t`` are any ``[f, d]`` views with unit-stride rows, so the
caller may pass the two halves of one fused ``[f, 2d]`` matrix (row ``j`` = up row ``j`` then down
column ``j``: one 8 KB span per unit at d = 2048), or two separate matrices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_launchable, check_pow2, check_tensor, check_weight_rows, width_key
from ..format import TwELL, twell_slots
from ._activity import fires
from ._dot import dot_operand, dot_precision
from ._launch import on_device_of
from .heavy_rows import launch_heavy_rows, weights_addressable
from .hot_units import HotUnits, hot_down

__all__ = ["ffn_from_twell", "OverflowCounters"]


@dataclass
class OverflowCounters:
    """Device counters of the exact path, accumulated over every call they are passed to.

    ``buffer`` is a ``[2]`` int64 tensor: ``tiles`` (``buffer[0]``) counts the (row, tile)
    pairs recomputed exactly because they overflowed, ``rows`` (``buffer[1]``) the rows that
    had at least one. Reading them (``int(c.tiles)``) syncs; the kernels never do.
    """

    buffer: torch.Tensor

    @classmethod
    def zeros(cls, device) -> "OverflowCounters":
        return cls(torch.zeros(2, dtype=torch.int64, device=device))

    @property
    def tiles(self) -> torch.Tensor:
        return self.buffer[0]

    @property
    def rows(self) -> torch.Tensor:
        return self.buffer[1]


@triton.jit
def _dense_row(over, cnt, row_limit, axis: tl.constexpr):
    """Rows computed whole by the dense-rows path: an overflowed tile, or more than
    ``row_limit`` active units (``over``, ``cnt``: tile flags and counts, tiles along ``axis``)."""
    return (tl.max(over.to(tl.int32), axis=axis) > 0) | (tl.sum(cnt, axis=axis) > row_limit)


@triton.jit
def _row_entry_counts(cnt_ptr, m, SLOTS, N_TILES, row_limit, NTP: tl.constexpr, WHOLE_ROWS: tl.constexpr):
    """Row m's tile counts and, over its stored entries (overflowed tiles left out), the
    inclusive and exclusive prefix sums and their total. WHOLE_ROWS: a row with an overflowed
    tile or more than ``row_limit`` active units has no entries to process here (the whole row
    is computed dense afterwards: _dense_row, as _dense_rows_kernel lists it)."""
    tiles = tl.arange(0, NTP)
    cnt = tl.load(cnt_ptr + m * N_TILES + tiles, mask=tiles < N_TILES, other=0)
    over = cnt > SLOTS
    c = tl.where(over, 0, cnt)
    if WHOLE_ROWS:
        c = tl.where(_dense_row(over, cnt, row_limit, 0), 0, c)
    incl = tl.cumsum(c, axis=0)
    return cnt, incl, incl - c, tl.sum(c, axis=0)


@triton.jit
def _row_entry_place(m, e, incl, excl, SLOTS, N_TILES, NTP: tl.constexpr):
    """Entry numbers e of row m -> (offset into values / cols, tile): entry e lives in the first
    tile whose inclusive prefix exceeds e."""
    tiles = tl.arange(0, NTP)
    t_e = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)
    base = tl.sum(tl.where(tiles[None, :] == t_e[:, None], excl[None, :], 0), axis=1)
    return m * N_TILES * SLOTS + t_e * SLOTS + (e - base), t_e


@triton.jit
def _row_entries(col_ptr, m, e0, n_entries, incl, excl, SLOTS, N_TILES, TILE, NTP: tl.constexpr, BE: tl.constexpr):
    """Entries ``e0 .. e0 + BE`` of row m: ``(valid, offset into values / cols, unit int64)``,
    the unit read from the entry's column in its tile."""
    e = e0 + tl.arange(0, BE)
    valid = e < n_entries
    off, t_e = _row_entry_place(m, e, incl, excl, SLOTS, N_TILES, NTP)
    col = tl.load(col_ptr + off, mask=valid, other=0).to(tl.int32)
    return valid, off, (t_e * TILE + col).to(tl.int64)


@triton.jit
def _dense_rows_kernel(cnt_ptr, M, SLOTS, N_TILES, row_limit, rows_ptr, n_ptr, ovf_ptr, BM: tl.constexpr, NTP: tl.constexpr):
    # The rows with an overflowed tile or more than row_limit active units (_dense_row),
    # appended to a list whose length (n_ptr, zeroed by the caller) stays on the device, in no
    # particular order; the counters take the overflowed tiles and the rows that have one.
    rows = tl.program_id(0) * BM + tl.arange(0, BM)
    tiles = tl.arange(0, NTP)
    ok = (rows < M)[:, None] & (tiles < N_TILES)[None, :]
    cnt = tl.load(cnt_ptr + rows.to(tl.int64)[:, None] * N_TILES + tiles[None, :], mask=ok, other=0)
    over = cnt > SLOTS
    listed = (_dense_row(over, cnt, row_limit, 1) & (rows < M)).to(tl.int32)
    n = tl.sum(listed, axis=0)
    if n > 0:
        base = tl.atomic_add(n_ptr, n)
        tl.store(rows_ptr + base + tl.cumsum(listed, axis=0) - 1, rows, mask=listed > 0)
        n_over = tl.sum(tl.max(over.to(tl.int32), axis=1), axis=0)
        if n_over > 0:
            tl.atomic_add(ovf_ptr, tl.sum(tl.sum(over.to(tl.int32), axis=1), axis=0).to(tl.int64))
            tl.atomic_add(ovf_ptr + 1, n_over.to(tl.int64))


@triton.jit
def _ffn_from_twell_kernel(
    x_ptr, stride_xm,
    cnt_ptr, val_ptr, col_ptr,
    wu_ptr, stride_wu,
    wd_ptr, stride_wd,
    wf_ptr, stride_wf,
    pre_ptr, stride_pm,
    y_ptr, stride_ym,
    ovf_ptr, uc_ptr, nnz_ptr, su_ptr, sd_ptr,
    d, f, SLOTS, N_TILES, TILE, row_limit,
    D: tl.constexpr, BE: tl.constexpr, NTP: tl.constexpr,
    GATED: tl.constexpr, HAS_PRE: tl.constexpr, TRACK: tl.constexpr, ONLY_OVER: tl.constexpr,
    SKIP_OVER: tl.constexpr, WHOLE_ROWS: tl.constexpr, ACC: tl.constexpr, SCALED: tl.constexpr,
):
    # ACC: y's row holds the hot units' part already (twell.kernels.hot_units); the sum starts from it.
    # SCALED: w_up and w_down^T rows are FP8 with one scale per unit (su, sd: twell.fp8); a unit's
    # scales multiply its h, in fp32.
    m = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D)
    dmask = offs_d < d
    cnt, incl, excl, n_entries = _row_entry_counts(cnt_ptr, m, SLOTS, N_TILES, row_limit, NTP, WHOLE_ROWS)
    over = cnt > SLOTS
    # ONLY_OVER: rows without an overflowed tile were done by another kernel; skip their x
    xmask = dmask
    if ONLY_OVER:
        xmask = dmask & ((offs_d * 0 + tl.sum(over.to(tl.int32), axis=0)) > 0)
    x = tl.load(x_ptr + m * stride_xm + offs_d, mask=xmask, other=0.0).to(tl.float32)
    ones = tl.full([BE], 1, dtype=tl.int32)

    acc = tl.zeros([D], dtype=tl.float32)
    if ACC:
        acc = tl.load(y_ptr + m * stride_ym + offs_d, mask=dmask, other=0.0).to(tl.float32)
    if ONLY_OVER:  # the stored entries were done by the launch before (narrow, split or row-block)
        n_entries = 0
    for e0 in range(0, n_entries, BE):
        valid, off, unit = _row_entries(col_ptr, m, e0, n_entries, incl, excl, SLOTS, N_TILES, TILE, NTP, BE)
        v = tl.load(val_ptr + off, mask=valid, other=0.0).to(tl.float32)
        wmask = valid[:, None] & dmask[None, :]
        if GATED:
            wu = tl.load(wu_ptr + unit[:, None] * stride_wu + offs_d[None, :], mask=wmask, other=0.0)
            h = v * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
            if SCALED:
                h = h * tl.load(su_ptr + unit, mask=valid, other=0.0)
        else:
            h = v
        if SCALED:
            h = h * tl.load(sd_ptr + unit, mask=valid, other=0.0)
        wd = tl.load(wd_ptr + unit[:, None] * stride_wd + offs_d[None, :], mask=wmask, other=0.0)
        acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
        if TRACK:
            tl.atomic_add(uc_ptr + unit, ones, mask=valid)

    n_over = tl.sum(over.to(tl.int32), axis=0)
    if SKIP_OVER:  # a second launch (ONLY_OVER, wider steps) does the overflowed tiles
        n_over = 0
    if n_over > 0:
        # Exact path: the whole tile, BE units at a time.
        tl.atomic_add(ovf_ptr, n_over.to(tl.int64))
        tl.atomic_add(ovf_ptr + 1, 1)
        for t in range(0, N_TILES):
            ct = tl.load(cnt_ptr + m * N_TILES + t)
            if ct > SLOTS:
                width = tl.minimum(TILE, f - t * TILE)
                for u0 in range(0, width, BE):
                    unit = (t * TILE + u0 + tl.arange(0, BE)).to(tl.int64)
                    umask = (u0 + tl.arange(0, BE)) < width
                    if HAS_PRE:
                        a = tl.load(pre_ptr + m * stride_pm + unit, mask=umask, other=0.0).to(tl.float32)
                    else:
                        wg = tl.load(wf_ptr + unit[:, None] * stride_wf + offs_d[None, :], mask=umask[:, None] & dmask[None, :], other=0.0)
                        a = tl.sum(wg.to(tl.float32) * x[None, :], axis=1)
                        # round like the stored gate values would be
                        a = a.to(val_ptr.dtype.element_ty).to(tl.float32)
                    active = umask & fires(a)
                    wmask = active[:, None] & dmask[None, :]
                    if GATED:
                        wu = tl.load(wu_ptr + unit[:, None] * stride_wu + offs_d[None, :], mask=wmask, other=0.0)
                        h = tl.where(active, a, 0.0) * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
                        if SCALED:
                            h = h * tl.load(su_ptr + unit, mask=active, other=0.0)
                    else:
                        h = tl.where(active, a, 0.0)
                    if SCALED:
                        h = h * tl.load(sd_ptr + unit, mask=active, other=0.0)
                    wd = tl.load(wd_ptr + unit[:, None] * stride_wd + offs_d[None, :], mask=wmask, other=0.0)
                    acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
                    if TRACK:
                        tl.atomic_add(uc_ptr + unit, ones, mask=active)

    if ONLY_OVER:
        if n_over > 0:
            acc += tl.load(y_ptr + m * stride_ym + offs_d, mask=dmask, other=0.0).to(tl.float32)
            tl.store(y_ptr + m * stride_ym + offs_d, acc.to(y_ptr.dtype.element_ty), mask=dmask)
    else:
        tl.store(y_ptr + m * stride_ym + offs_d, acc.to(y_ptr.dtype.element_ty), mask=dmask)
    if TRACK:
        tl.store(nnz_ptr + m, tl.sum(cnt, axis=0))


@triton.jit
def _twell_up_kernel(
    x_ptr, stride_xm, cnt_ptr, val_ptr, col_ptr, wu_ptr, stride_wu, h_ptr, su_ptr, sd_ptr,
    d, SLOTS, N_TILES, TILE, row_limit,
    D: tl.constexpr, BE: tl.constexpr, NTP: tl.constexpr, WHOLE_ROWS: tl.constexpr, SCALED: tl.constexpr,
):
    # Split path, first launch (gated): h = g (x[m] . w_up[j]) for each stored entry, kept in
    # fp32 at the entry's place in a TwELL-shaped scratch. Only w_up rows are gathered here and only
    # w_down^T rows in the second launch: each launch's rows (23 MB at f 5632, d 2048) fit in the
    # H200's L2, the pair (46 MB) does not. Same products in the same order as the fused kernel: the
    # same y, bit for bit. SCALED (FP8 rows, twell.fp8): both of the unit's scales multiply h here,
    # the down launch reads h as it is.
    m = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D)
    dmask = offs_d < d
    cnt, incl, excl, n_entries = _row_entry_counts(cnt_ptr, m, SLOTS, N_TILES, row_limit, NTP, WHOLE_ROWS)
    x = tl.load(x_ptr + m * stride_xm + offs_d, mask=dmask, other=0.0).to(tl.float32)
    for e0 in range(0, n_entries, BE):
        valid, off, unit = _row_entries(col_ptr, m, e0, n_entries, incl, excl, SLOTS, N_TILES, TILE, NTP, BE)
        v = tl.load(val_ptr + off, mask=valid, other=0.0).to(tl.float32)
        wu = tl.load(wu_ptr + unit[:, None] * stride_wu + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        h = v * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        if SCALED:
            h = h * tl.load(su_ptr + unit, mask=valid, other=0.0) * tl.load(sd_ptr + unit, mask=valid, other=0.0)
        tl.store(h_ptr + off, h, mask=valid)


@triton.jit
def _twell_down_kernel(
    cnt_ptr, col_ptr, h_ptr, wd_ptr, stride_wd, y_ptr, stride_ym, uc_ptr, nnz_ptr,
    d, SLOTS, N_TILES, TILE, row_limit,
    D: tl.constexpr, BE: tl.constexpr, NTP: tl.constexpr, TRACK: tl.constexpr, WHOLE_ROWS: tl.constexpr,
    ACC: tl.constexpr,
):
    # Split path, second launch: y[m] = sum_j h_j w_down^T[j] over the stored entries (the
    # overflowed tiles' come from the exact launch after it, which adds to y). ACC: y[m] holds
    # the hot units' part already, and the sum starts from it.
    m = tl.program_id(0).to(tl.int64)
    offs_d = tl.arange(0, D)
    dmask = offs_d < d
    cnt, incl, excl, n_entries = _row_entry_counts(cnt_ptr, m, SLOTS, N_TILES, row_limit, NTP, WHOLE_ROWS)
    ones = tl.full([BE], 1, dtype=tl.int32)
    acc = tl.zeros([D], dtype=tl.float32)
    if ACC:
        acc = tl.load(y_ptr + m * stride_ym + offs_d, mask=dmask, other=0.0).to(tl.float32)
    for e0 in range(0, n_entries, BE):
        valid, off, unit = _row_entries(col_ptr, m, e0, n_entries, incl, excl, SLOTS, N_TILES, TILE, NTP, BE)
        h = tl.load(h_ptr + off, mask=valid, other=0.0)
        wd = tl.load(wd_ptr + unit[:, None] * stride_wd + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        acc += tl.sum(h[:, None] * wd.to(tl.float32), axis=0)
        if TRACK:
            tl.atomic_add(uc_ptr + unit, ones, mask=valid)
    tl.store(y_ptr + m * stride_ym + offs_d, acc.to(y_ptr.dtype.element_ty), mask=dmask)
    if TRACK:
        tl.store(nnz_ptr + m, tl.sum(cnt, axis=0))


@triton.jit
def _block_entries(ch, incl, excl, r_local, n_entries, col_ptr, row0, SLOTS, BE: tl.constexpr):
    # Chunk ch of a token block's concatenated entries: entry e belongs to the first token whose
    # inclusive prefix count exceeds e. Returns (e, valid, token in block, TwELL offset, unit).
    e = ch * BE + tl.arange(0, BE)
    valid = e < n_entries
    tok = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)
    slot = e - tl.sum(tl.where(r_local[None, :] == tok[:, None], excl[None, :], 0), axis=1)
    off = (row0 + tok).to(tl.int64) * SLOTS + slot
    unit = tl.load(col_ptr + off, mask=valid, other=0).to(tl.int64)
    return e, valid, tok, off, unit


@triton.jit
def _ffn_rows_dot_kernel(
    x_ptr, stride_xm,
    cnt_ptr, val_ptr, col_ptr,
    wu_ptr, stride_wu,
    wd_ptr, stride_wd,
    h_ptr, y_ptr, stride_ym, uc_ptr,
    M, d, SLOTS,
    BM: tl.constexpr, BE: tl.constexpr, BK: tl.constexpr, KSTEPS: tl.constexpr,
    GATED: tl.constexpr, TRACK: tl.constexpr, PREC: tl.constexpr,
):
    # BM tokens of a one-tile TwELL (each row's entries contiguous). Their entries, concatenated,
    # are taken BE at a time; entry e belongs to token tok(e) of the block.
    #   phase 1 (gated): U[BE, BM] = W_up[units] @ X^T (tensor cores; only column tok(e) of
    #                    row e is used), h_e = g_e * U[e, tok(e)], kept in a small scratch;
    #   phase 2:         Y[BM, BK] += H[BM, BE] @ W_down^T[units, d-chunk], H one-hot by token.
    # The gathers feed tl.dot, so Triton pipelines them (cp.async), and no reduction crosses warps.
    pid = tl.program_id(0)
    r_local = tl.arange(0, BM)
    rows = (pid * BM + r_local).to(tl.int64)
    rmask = rows < M
    cnt = tl.load(cnt_ptr + rows, mask=rmask, other=0)
    c = tl.where(cnt > SLOTS, 0, cnt)  # overflowed rows: done by the exact path afterwards
    incl = tl.cumsum(c, axis=0)
    excl = incl - c
    n_entries = tl.sum(c, axis=0)
    n_chunks = tl.cdiv(n_entries, BE)
    ks = tl.arange(0, BK)
    if GATED:
        U = tl.zeros([BE, BM], dtype=tl.float32)
        for it in range(0, n_chunks * KSTEPS):
            ch = it // KSTEPS
            kk = it % KSTEPS
            e, valid, tok, off, unit = _block_entries(ch, incl, excl, r_local, n_entries, col_ptr, pid * BM, SLOTS, BE)
            kd = kk * BK + ks
            kmask = kd < d
            wu = tl.load(wu_ptr + unit[:, None] * stride_wu + kd[None, :], mask=valid[:, None] & kmask[None, :], other=0.0)
            xt = tl.load(x_ptr + rows[None, :] * stride_xm + kd[:, None], mask=rmask[None, :] & kmask[:, None], other=0.0)
            U = tl.where(kk == 0, 0.0, U)
            U = tl.dot(dot_operand(wu, PREC), dot_operand(xt, PREC), U, input_precision=PREC)
            u = tl.sum(tl.where(tok[:, None] == r_local[None, :], U, 0.0), axis=1)
            last = valid & ((tl.zeros([BE], dtype=tl.int32) + kk) == KSTEPS - 1)
            g = tl.load(val_ptr + off, mask=last, other=0.0).to(tl.float32)
            tl.store(h_ptr + off, g * u, mask=last)
        tl.debug_barrier()  # phase 2 reads what other threads of this program wrote
    n_chunks2 = tl.maximum(n_chunks, 1)
    Y = tl.zeros([BM, BK], dtype=tl.float32)
    for it in range(0, KSTEPS * n_chunks2):
        dk = it // n_chunks2
        ch = it % n_chunks2
        e, valid, tok, off, unit = _block_entries(ch, incl, excl, r_local, n_entries, col_ptr, pid * BM, SLOTS, BE)
        if GATED:
            h = tl.load(h_ptr + off, mask=valid, other=0.0)
        else:
            h = tl.load(val_ptr + off, mask=valid, other=0.0).to(tl.float32)
        H = tl.where(r_local[:, None] == tok[None, :], h[None, :], 0.0).to(wd_ptr.dtype.element_ty)
        dd = dk * BK + ks
        dmask = dd < d
        wd = tl.load(wd_ptr + unit[:, None] * stride_wd + dd[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        Y = tl.where(ch == 0, 0.0, Y)
        Y = tl.dot(dot_operand(H, PREC), dot_operand(wd, PREC), Y, input_precision=PREC)
        tl.store(y_ptr + rows[:, None] * stride_ym + dd[None, :], Y.to(y_ptr.dtype.element_ty),
                 mask=(rmask[:, None] & dmask[None, :]) & ((tl.zeros([BM, 1], dtype=tl.int32) + ch) == n_chunks2 - 1))
        if TRACK:
            tl.atomic_add(uc_ptr + unit, tl.full([BE], 1, dtype=tl.int32), mask=valid & ((tl.zeros([BE], dtype=tl.int32) + dk) == 0))


# Tuned (entries per step, warps) per padded d, from the H200 sweeps; other sizes keep a [BE, D]
# block near 16K elements. At d 2048 two entries a step won below about 40 active units per token
# (131072 tokens: k 8 1.46 against 1.64 ms with four, k 29 3.88 against 4.04, heavy rows 5.74
# against 6.13; 4096 tokens, k 29: 0.14 against 0.22), four from there at that batch (k 56: 6.90
# against 7.12; see WIDE_STEP below). Skewed units at k 29 ran 3.49 against 3.40 ms with two entries
# (2 x 2 programs: 3.29), and at 4096 tokens two entries still won at k 56 (0.247 against 0.263 ms).
# At d 4096 (f 11008) two and four entries with four warps tied and beat (4, 8) by 15 to 20% (H100,
# k 29: 4096 tokens 0.564 / 0.569 against 0.682 ms, 16384 tokens 2.224 / 2.225 against 2.627, 65536
# tokens 9.275 / 9.261 against 10.890); gated calls of that d take the split path from
# SPLIT_MIN_M_BY_D tokens anyway. Non-gated calls at d 4096 were not measured with this shape.
TUNED: dict[int, tuple[int, int]] = {2048: (2, 4), 4096: (2, 4)}
# WIDE_STEP: per padded d, the mean active units per token from which the fused kernel takes a
# second shape. At d 2048 the 131072-token sweep above favours (40, (4, 4)), but gated calls of
# that size take the split path, and below it four entries lost: the module at 16384 tokens
# ran 1.631 / 1.792 ms with them against 1.544 / 1.701 with two at k 48 / 56 (H100). Empty:
# every d keeps its TUNED shape.
WIDE_STEP: dict[int, tuple[float, tuple[int, int]]] = {}


# From this many tokens on, overflowed tiles go to a second launch with (units per step,
# warps) = EXACT_CONFIG instead of the narrow programs of the first.
TWO_PASS_MIN_M = 4096
EXACT_CONFIG: tuple[int, int] = (8, 8)
# ...or, where the caller lets ffn_from_twell overwrite ``pre`` (``pre_writable``: the modules
# and twell_gated_mlp, whose pre-activation is their own), the rows with an overflowed tile (and
# those above DENSE_ROW_MIN) are listed on the device and computed whole as the dense MLP
# computes them, on tensor cores over
# blocks of listed rows (twell.kernels.heavy_rows, at DENSE_ROWS_CONFIG). The per-row exact
# launch is one program per token, and a row's overflowed tile is a serial walk over its units:
# at 131072 tokens it took 0.17 ms with nothing overflowed and 2.3 ms for 361 heavy rows (k 29),
# at 16384 tokens 1.4 ms for 25 heavy rows.
DENSE_ROWS_CONFIG: dict = dict(block_m=64, block_n=128, block_k=64, num_warps=4, num_stages=3)
# Rows with more than this many active units take the dense-rows path too, overflowed or not: a
# long row is the serial tail of the first launch (one program per token), while on tensor cores a
# whole row costs about what a hundred entries cost there. The forced op with heavy rows (H200,
# bf16, d 2048, f 5632) at limits 128 / 256 / 512 / none: 131072 tokens k 29 2.01x / 1.92x / 1.74x /
# 1.48x dense, k 56 1.88x / 1.81x / 1.55x / 1.32x; 16384 tokens k 29 1.82x / 1.70x / 1.47x / 1.17x.
# twell.inference.dispatch prices the layer's rows with it.
DENSE_ROW_MIN = 128
LIST_ROWS_BLOCK = 256

# The split path (gated; up products in one launch, down rows in a second) from this many tokens on,
# with (entries per step, warps) = SPLIT_CONFIG per padded d. H200, bf16, d 2048: at 131072 tokens
# split 4 x 4 against the fused 2 x 4 / 4 x 4: k 8 1.415 against 1.470 ms, k 29 3.99 against 4.16,
# k 56 6.94 against 6.99, skewed 3.38 against 3.44, heavy rows 6.66 against 6.59; at 16384 tokens
# within 2% either way, at 4096 up to 25% slower (one entry a step with two warps was fastest at
# 131072 for even and skewed units, up to 12%, but 11% slower with heavy rows).
SPLIT_MIN_M = 65536
# ...except per padded d listed here. At d 4096, f 11008 the up and down weights (180 MB) are far
# larger than L2 and the split path won at every batch measured (H100, bf16, k 29 / 56 against the
# best fused shape): 4096 tokens 0.416 / 0.649 against 0.564 / 0.988 ms, 16384 tokens 1.696 / 2.376
# against 2.224 / 4.049, 65536 tokens 7.329 / 9.386 against 9.261 / 17.050 (the H200 at 16384
# tokens: k 29 1.297 against 1.539, k 56 2.224 against 2.808). Below 4096 tokens not measured.
SPLIT_MIN_M_BY_D: dict[int, int] = {4096: 4096}
# d 4096: two entries a step won at k 56 (16384 tokens 2.376 against 2.532 ms with one, 65536
# tokens 9.386 against 10.773), one entry at k 29 (SPLIT_NARROW below).
SPLIT_CONFIG: dict[int, tuple[int, int]] = {2048: (4, 4), 4096: (2, 4)}
# ...and SPLIT_NARROW (one entry a step) when the rows are about equally long: the root mean
# square of the active units per token at most SPLIT_NARROW_MAX_SPREAD times their mean, as the
# module's probes measure them (evenly spread and skewed units: 1.01 to 1.07). Long rows run their
# loop once per entry there, so rows of unequal length keep SPLIT_CONFIG. At 131072 tokens, 1 x 2
# against 4 x 4: k 29 3.89 against 4.03 ms, k 56 6.87 against 7.05, skewed k 29 3.10 against 3.41,
# skewed k 56 6.10 against 6.46, k 8 1.32 against 1.42; heavy rows at spread 1.26 4.12 against 4.12,
# at 1.50 4.40 against 4.25, at 3.66 7.36 against 6.68.
# At d 4096 one entry a step won only at low k (k 29: 1.696 against 1.909 ms with two at 16384
# tokens, 7.329 with eight warps against 8.042 at 65536; k 56 lost, above), so there it needs a
# mean below SPLIT_NARROW_MAX_K too.
SPLIT_NARROW: dict[int, tuple[int, int]] = {2048: (1, 2), 4096: (1, 4)}
SPLIT_NARROW_MAX_SPREAD = 1.3
SPLIT_NARROW_MAX_K: dict[int, float] = {4096: 40.0}

# Row-block kernel (BM tokens, BE entries, BK columns of d per step, warps).
ROWS_CONFIG: tuple[int, int, int, int] = (16, 64, 128, 4)


def split_min_m(d: Optional[int] = None) -> int:
    """Tokens from which ``"auto"`` takes the split path for model width ``d`` (padded to a power
    of two): ``SPLIT_MIN_M_BY_D`` where it lists the width, else ``SPLIT_MIN_M``."""
    if d is None:
        return SPLIT_MIN_M
    return SPLIT_MIN_M_BY_D.get(width_key(d), SPLIT_MIN_M)


def splits(M: int, gated: bool, kernel: str = "auto", d: Optional[int] = None) -> bool:
    """Whether :func:`ffn_from_twell` takes the split path (up, then down: two launches) for a
    call of ``M`` tokens of width ``d`` (see :func:`split_min_m`)."""
    return gated and (kernel == "split" or (kernel == "auto" and M >= split_min_m(d)))


def default_config(d: int, mean_k: Optional[float] = None, split: bool = False,
                   rms_k: Optional[float] = None) -> tuple[int, int]:
    """``(block_e, num_warps)`` used when the caller passes none; ``mean_k``: the expected active
    units per token and ``rms_k`` their root mean square over the tokens, where the caller
    knows them (the modules' estimate); ``split``: for the split path's two launches
    (:func:`splits`)."""
    D = width_key(d)
    if split:
        if (D in SPLIT_NARROW and mean_k and rms_k is not None and rms_k <= SPLIT_NARROW_MAX_SPREAD * mean_k
                and mean_k < SPLIT_NARROW_MAX_K.get(D, float("inf"))):
            return SPLIT_NARROW[D]
        if D in SPLIT_CONFIG:
            return SPLIT_CONFIG[D]
    if mean_k is not None and D in WIDE_STEP and mean_k >= WIDE_STEP[D][0]:
        return WIDE_STEP[D][1]
    if D in TUNED:
        return TUNED[D]
    return max(2, min(16, 16384 // D)), (4 if D <= 1024 else 8)


def _shares_elements(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether two 2-D tensors with unit-stride rows may share an element: same storage and
    intersecting spans, unless both have one row stride and disjoint column windows within it
    (two halves of one ``[M, 2d]`` buffer)."""
    if a.numel() == 0 or b.numel() == 0 or a.device != b.device:
        return False
    if a.untyped_storage().data_ptr() != b.untyped_storage().data_ptr():
        return False
    size = a.element_size()

    def span(t):
        lo = t.storage_offset() * t.element_size()
        hi = lo + (sum((n - 1) * st for n, st in zip(t.shape, t.stride())) + 1) * t.element_size()
        return lo, hi

    (alo, ahi), (blo, bhi) = span(a), span(b)
    if ahi <= blo or bhi <= alo:
        return False
    if b.element_size() == size and a.stride(0) == b.stride(0) > 0 and a.stride(1) == b.stride(1) == 1:
        s = a.stride(0)
        ca, cb = a.storage_offset() % s, b.storage_offset() % s
        if ca + a.shape[1] <= s and cb + b.shape[1] <= s and (ca + a.shape[1] <= cb or cb + b.shape[1] <= ca):
            return False  # each row of one lies in a column window the other's rows never touch
    return True


def _count_hot(g: TwELL, pre: torch.Tensor, hot: HotUnits, row_limit: int, unit_counts: torch.Tensor,
               row_nnz: torch.Tensor) -> None:
    """The statistics of the hot units, which the TwELL ``g`` leaves out: every row's count, and
    each unit's tokens over the rows not computed whole (those count all their units
    themselves, :func:`twell.kernels.heavy_rows.launch_heavy_rows`). From ``pre`` before the rows
    computed whole are written over."""
    fire = ~(pre.index_select(1, hot.units) <= 0)  # relu(a) != 0: a > 0, or NaN (as _activity.fires)
    row_nnz += fire.sum(dim=1, dtype=torch.int32)
    over = g.counts > g.slots
    whole = over.any(dim=1) | (g.counts.sum(dim=1) > row_limit)  # as _dense_row lists them
    unit_counts.index_add_(0, hot.units, (fire & ~whole[:, None]).sum(dim=0, dtype=torch.int32))


def ffn_from_twell(
    x: torch.Tensor,
    g: TwELL,
    w_down_t: torch.Tensor,
    *,
    w_up: Optional[torch.Tensor] = None,
    w_first: Optional[torch.Tensor] = None,
    pre: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    counters: Optional[OverflowCounters] = None,
    unit_counts: Optional[torch.Tensor] = None,
    row_nnz: Optional[torch.Tensor] = None,
    block_e: Optional[int] = None,
    num_warps: Optional[int] = None,
    kernel: str = "auto",
    pre_writable: bool = False,
    hot: Optional[tuple[torch.Tensor, HotUnits]] = None,
    one_launch: bool = False,
    w_scales: Optional[tuple[Optional[torch.Tensor], torch.Tensor]] = None,
) -> torch.Tensor:
    """``y [M, d]`` from a TwELL: gated up/down when ``w_up`` is given, else the down projection.

    Args:
        x: ``[M, d]`` tokens (fp16, bf16 or fp32; rows with unit stride).
        g: TwELL ``[M, f]``: the gate ``relu(x w_gate^T)`` (gated) or ``h = relu(x w_up^T)``
            (non-gated), e.g. from :func:`twell.kernels.pack_relu`; values in x's dtype.
        w_down_t: ``[f, d]``, row ``j`` = ``w_down[:, j]`` (``w_down.T.contiguous()``, or the
            second half of a fused ``[f, 2d]`` matrix).
        w_up: ``[f, d]`` up rows (gated). None: non-gated, ``h`` is taken from ``g``.
        w_first: ``[f, d]`` the first projection (``w_gate`` if gated, else ``w_up``), to
            recompute overflowed tiles; or
        pre: ``[M, f]`` the dense pre-activation ``x w_first^T`` that ``g`` was packed from,
            read for overflowed tiles instead of recomputing. One of the two is required.
        out: optional ``[M, d]`` output (x's dtype).
        counters: :class:`OverflowCounters` to add the exact path's counts to.
        unit_counts: optional ``[f]`` int32, incremented by the number of tokens each unit
            fired for; row_nnz: optional ``[M]`` int32, set to each row's true non-zero count.
            Pass both or neither.
        block_e, num_warps: tuning knobs (entries per step, warps per program).
        pre_writable: ``pre`` is the caller's scratch: from ``TWO_PASS_MIN_M`` tokens on, the
            rows with an overflowed tile or more than ``DENSE_ROW_MIN`` active units are then
            computed whole on tensor cores (listed on the device, no host synchronisation) and
            their rows of ``pre`` overwritten with ``h``, instead of an exact program per token
            for the overflowed ones and the first launch for the others; ``y`` of those rows as the dense MLP
            rounds it. False (the default): ``pre`` is only read.
        kernel: ``"token"``: one program per token, any tile, up and down fused;
            ``"split"`` (gated only): one program per token, the up products in one launch
            (``h`` kept in an fp32 TwELL-shaped scratch) and the down rows in a second, so each
            launch's weight rows fit in L2; the same ``y`` bit for bit. ``"auto"`` (the default)
            takes ``"split"`` for gated calls of at least :func:`split_min_m` tokens, else ``"token"``;
            ``"rows"``: token blocks on tensor cores (needs a one-tile TwELL, ``tile >= f``),
            then the exact path for overflowed rows. ``"rows"`` measured 2.5 to 3 times slower
            than ``"token"`` on the H200 and is kept for study.

        hot: ``(h_hot, units)`` from :func:`twell.kernels.gate_pack.pack_relu_hot`: ``g`` holds
            the cold units only and ``h_hot [M, nh]`` the hot units' hidden values, whose dense
            block (:func:`twell.kernels.hot_units.hot_down`) is written to ``y`` first; the
            up/down kernels then add the cold units to it, and the rows computed whole are
            written over last. ``h_hot`` must not overlap ``out``. In float16 the hot part's
            rounding can overflow where the dense MLP's single rounding would not (a hot part
            past 65504 that the cold units bring back); the module keeps to bfloat16 and
            float32 for hot units. Needs the dense-rows path
            (``pre`` given, ``pre_writable``, at least ``TWO_PASS_MIN_M`` tokens, any kernel but
            ``"rows"``): there every overflowed tile's row is computed whole from ``pre``, whose
            hot columns the pack left as they were.

        one_launch: the fused kernel (``"token"``) in one launch at any batch, as below
            ``TWO_PASS_MIN_M`` tokens: every row in its token's program, an overflowed tile
            recomputed there (exact); no listing, no second launch, and ``pre`` only read. For
            callers that know the rows short (the module, from its probes): at 4096 tokens the
            two-pass path's five small launches with nothing to do cost about 5% of the call,
            while a long or overflowed row in one launch is its serial tail. Not with ``hot``,
            ``"split"`` or ``"rows"``.

        w_scales: ``(up_scale, down_scale)``, float32 ``[f]`` each (``up_scale`` None when
            non-gated): ``w_up`` and ``w_down_t`` are then ``float8_e4m3fn`` rows, unit ``j``'s
            row meaning ``scale[j] * row`` (:class:`twell.fp8.Fp8Rows`); the scales multiply h
            in fp32. Needs ``pre`` (the FP8 gate's output: overflowed tiles read it), and not
            ``hot`` or ``"rows"``; gated only with ``pre_writable`` (the rows computed whole widen
            the e4m3 rows for tensor cores, :mod:`.heavy_rows`).

    Returns:
        ``y [M, d]``.
    """
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    if not isinstance(g, TwELL):
        raise TypeError(f"g must be a twell.TwELL, got {type(g).__name__}")
    M, d = x.shape
    f = g.f
    if g.values.shape[0] != M:
        raise ValueError(f"g has {g.values.shape[0]} rows but x has {M}")
    if g.values.dtype != x.dtype:
        raise TypeError(f"g.values has dtype {g.values.dtype} but x has {x.dtype}; they must match")
    for t, name in ((g.values, "g.values"), (g.cols, "g.cols"), (g.counts, "g.counts")):
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    n_tiles = -(-f // g.tile)
    if (
        tuple(g.counts.shape) != (M, n_tiles)
        or g.cols.shape != g.values.shape
        or g.values.shape[1] != n_tiles
        or g.slots != twell_slots(g.tile, g.compression)
    ):
        raise ValueError(
            f"inconsistent TwELL for f = {f}, tile = {g.tile}, compression = {g.compression}: values "
            f"{list(g.values.shape)}, cols {list(g.cols.shape)}, counts {list(g.counts.shape)}"
        )
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit-stride rows, got strides {x.stride()}")
    for t, name in ((g.values, "g.values"), (g.cols, "g.cols"), (g.counts, "g.counts")):
        if not t.is_contiguous():
            raise ValueError(f"{name} must be contiguous")
    if w_down_t is None:
        raise ValueError("w_down_t ([f, d], w_down.T.contiguous()) is required")
    scaled = w_scales is not None
    if scaled:
        from ..fp8 import E4M3

        if not isinstance(w_scales, (tuple, list)) or len(w_scales) != 2:
            raise TypeError("w_scales must be (up_scale or None, down_scale)")
        if (w_scales[0] is None) != (w_up is None):
            raise ValueError("w_scales: give up_scale exactly when w_up is given (gated)")
        for t, name in zip(w_scales, ("up_scale", "down_scale")):
            if t is not None:
                check_tensor(t, name, dim=1, dtypes=(torch.float32,))
                if t.shape[0] != f or not t.is_contiguous() or t.device != x.device:
                    raise ValueError(f"{name} must be a contiguous [{f}] float32 tensor on {x.device}")
        if pre is None:
            raise ValueError("FP8 rows (w_scales) need pre, the gate's output: overflowed tiles are read from it")
        if hot is not None or kernel == "rows":
            raise ValueError("FP8 rows (w_scales) take neither hot units nor kernel='rows'")
        pre_writable = pre_writable and w_up is not None
    check_weight_rows(w_down_t, "w_down_t", f, d, x, dtype=E4M3 if scaled else None)
    check_weight_rows(w_up, "w_up", f, d, x, dtype=E4M3 if scaled else None)
    check_weight_rows(w_first, "w_first", f, d, x)
    if pre is None and w_first is None:
        raise ValueError(
            "pass pre ([M, f] pre-activation) or w_first (w_gate, or w_up if non-gated): "
            "overflowed tiles are recomputed from one of them"
        )
    if pre is not None:
        check_tensor(pre, "pre", dim=2, dtypes=KERNEL_DTYPES)
        if pre.dtype != x.dtype:
            raise TypeError(f"pre has dtype {pre.dtype} but x has {x.dtype}; they must match")
        if tuple(pre.shape) != (M, f) or pre.stride(1) != 1 or pre.device != x.device:
            raise ValueError(f"pre must be [M, f] = [{M}, {f}] with unit-stride rows on {x.device}, got {list(pre.shape)} strides {pre.stride()}")
    check_launchable(x, "x")
    if (unit_counts is None) != (row_nnz is None):
        raise ValueError("pass unit_counts and row_nnz together, or neither")
    if unit_counts is not None:
        check_tensor(unit_counts, "unit_counts", dim=1, dtypes=(torch.int32,))
        check_tensor(row_nnz, "row_nnz", dim=1, dtypes=(torch.int32,))
        if unit_counts.shape[0] != f or row_nnz.shape[0] != M or not unit_counts.is_contiguous() or not row_nnz.is_contiguous():
            raise ValueError(f"unit_counts must be contiguous [{f}] and row_nnz [{M}]")
        if unit_counts.device != x.device or row_nnz.device != x.device:
            raise ValueError(f"unit_counts and row_nnz must be on x's device {x.device}")
    if out is None:
        out = torch.empty(M, d, dtype=x.dtype, device=x.device)
    elif tuple(out.shape) != (M, d) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device or (M > 1 and out.stride(0) < d):
        raise ValueError(f"out must be [{M}, {d}] {x.dtype} on {x.device} with unit-stride, non-overlapping rows")
    elif _shares_elements(out, x):
        # the programs read x's rows after other programs may have written out's (the exact path,
        # the dense rows, the split kernel's second launch): the result would depend on the order
        raise ValueError("out must not overlap x (ffn_from_twell reads x while it writes out)")
    if counters is None:
        counters = OverflowCounters.zeros(x.device)
    ovf = counters.buffer
    if ovf.dtype != torch.int64 or tuple(ovf.shape) != (2,) or ovf.device != x.device or not ovf.is_contiguous():
        raise ValueError("counters.buffer must be a [2] int64 tensor on x's device (OverflowCounters.zeros)")
    if kernel not in ("auto", "rows", "token", "split"):
        raise ValueError(f"kernel must be 'auto', 'rows', 'token' or 'split', got {kernel!r}")
    if kernel == "split" and w_up is None:
        raise ValueError("kernel='split' is the gated FFN's: pass w_up")
    if one_launch and (kernel in ("rows", "split") or hot is not None):
        raise ValueError("one_launch is the fused kernel's: not with kernel='split' or 'rows', nor with hot units")
    if kernel == "rows" and g.n_tiles != 1:
        raise ValueError(f"kernel='rows' needs a one-tile TwELL (tile >= f), got {g.n_tiles} tiles")
    rows_kernel = kernel == "rows"
    if M == 0:
        return out
    if f == 0:  # no units: y = 0 (and no tiles for a kernel to walk)
        return out.zero_()
    # overflowed and long rows whole, on tensor cores (see DENSE_ROWS_CONFIG; x's rows at any stride)
    two_pass = M >= TWO_PASS_MIN_M and not one_launch
    dense_rows = (pre is not None and pre_writable and not rows_kernel and two_pass
                  and weights_addressable(w_down_t, w_up))  # (else the exact launch below, as without pre_writable)
    if hot is not None:
        h_hot, hot_set = hot
        if not isinstance(hot_set, HotUnits):
            raise TypeError(f"hot must be (h_hot, HotUnits), got a {type(hot_set).__name__} for its units")
        hot_set.check(f, x.device)
        check_tensor(h_hot, "h_hot", dim=2, dtypes=KERNEL_DTYPES)
        if tuple(h_hot.shape) != (M, hot_set.n) or h_hot.dtype != x.dtype or not h_hot.is_contiguous() or h_hot.device != x.device:
            raise ValueError(f"h_hot must be a contiguous [{M}, {hot_set.n}] {x.dtype} tensor on {x.device}, "
                             f"got {list(h_hot.shape)} {h_hot.dtype} on {h_hot.device}")
        if hot_set.n and _shares_elements(out, h_hot):
            raise ValueError("out must not overlap h_hot (the hot block is written to out first)")
        if not dense_rows:
            # the per-token exact launch would add the hot units of an overflowed tile again
            raise ValueError(f"hot units need the dense-rows path: pre given, pre_writable=True, at least "
                             f"TWO_PASS_MIN_M = {TWO_PASS_MIN_M} tokens (got {M}), kernel other than 'rows'")
    row_limit = DENSE_ROW_MIN
    # the hot units' block first, written to out; the up/down kernels add the cold units to it
    add_to_out = hot is not None and hot[1].n > 0
    D = triton.next_power_of_2(max(d, 1))
    gated = w_up is not None
    split = not rows_kernel and not one_launch and splits(M, gated, kernel, d)
    be0, nw0 = default_config(d, split=split)
    if block_e is not None:
        check_pow2(block_e, "block_e", 1, 64)
    if num_warps is not None:
        check_pow2(num_warps, "num_warps", 1, 32)
    BE = block_e or be0
    nw = num_warps or nw0
    dummy = w_down_t
    # the scales (unread placeholders where the rows are not FP8)
    su = w_scales[0] if scaled and gated else ovf
    sd = w_scales[1] if scaled else ovf
    with on_device_of(x):
        if rows_kernel:
            bm, be, bk, nw_rows = ROWS_CONFIG
            if block_e:
                be = BE
            h = torch.empty(M, g.slots, dtype=torch.float32, device=x.device) if gated else out
            _ffn_rows_dot_kernel[(triton.cdiv(M, bm),)](
                x, x.stride(0), g.counts, g.values, g.cols,
                w_up if gated else dummy, (w_up if gated else dummy).stride(0),
                w_down_t, w_down_t.stride(0),
                h, out, out.stride(0), unit_counts if unit_counts is not None else g.counts,
                M, d, g.slots,
                BM=bm, BE=be, BK=bk, KSTEPS=triton.cdiv(d, bk), GATED=gated, TRACK=unit_counts is not None,
                PREC=dot_precision(x), num_warps=num_warps or nw_rows,
            )
        def token_kernel(only_over, skip_over, be, warps):
            _ffn_from_twell_kernel[(M,)](
                x, x.stride(0),
                g.counts, g.values, g.cols,
                w_up if gated else dummy, (w_up if gated else dummy).stride(0),
                w_down_t, w_down_t.stride(0),
                w_first if w_first is not None else dummy, (w_first if w_first is not None else dummy).stride(0),
                pre if pre is not None else x, pre.stride(0) if pre is not None else 0,
                out, out.stride(0),
                ovf, unit_counts if unit_counts is not None else g.counts, row_nnz if row_nnz is not None else g.counts,
                su, sd,
                d, f, g.slots, g.n_tiles, g.tile, row_limit,
                D=D, BE=be, NTP=triton.next_power_of_2(g.n_tiles), GATED=gated, HAS_PRE=pre is not None,
                TRACK=unit_counts is not None, ONLY_OVER=only_over, SKIP_OVER=skip_over, WHOLE_ROWS=dense_rows,
                ACC=add_to_out and not only_over, SCALED=scaled, num_warps=warps,
            )

        def exact_launch():
            if hot is not None and unit_counts is not None:
                # before the rows computed whole are written over (pre's rows too)
                _count_hot(g, pre, hot[1], row_limit, unit_counts, row_nnz)
            if not dense_rows:
                token_kernel(True, False, *EXACT_CONFIG)  # the overflowed tiles, added to y
                return
            rows = torch.empty(M, dtype=torch.int32, device=x.device)
            n_rows = torch.zeros(1, dtype=torch.int32, device=x.device)
            _dense_rows_kernel[(triton.cdiv(M, LIST_ROWS_BLOCK),)](
                g.counts, M, g.slots, g.n_tiles, row_limit, rows, n_rows, ovf, BM=LIST_ROWS_BLOCK,
                NTP=triton.next_power_of_2(g.n_tiles),
            )
            launch_heavy_rows(x, pre, rows, n_rows, out, w_down_t.t(), w_up, None, unit_counts, **DENSE_ROWS_CONFIG,
                              w_scales=w_scales if scaled else None)

        if add_to_out:
            hot_down(hot[0], hot[1], w_down_t, out)
        if rows_kernel:
            token_kernel(True, False, BE, nw)
        elif split:
            h = torch.empty(g.values.shape, dtype=torch.float32, device=x.device)
            NTP = triton.next_power_of_2(g.n_tiles)
            _twell_up_kernel[(M,)](
                x, x.stride(0), g.counts, g.values, g.cols, w_up, w_up.stride(0), h, su, sd,
                d, g.slots, g.n_tiles, g.tile, row_limit, D=D, BE=BE, NTP=NTP, WHOLE_ROWS=dense_rows, SCALED=scaled,
                num_warps=nw,
            )
            _twell_down_kernel[(M,)](
                g.counts, g.cols, h, w_down_t, w_down_t.stride(0), out, out.stride(0),
                unit_counts if unit_counts is not None else g.counts, row_nnz if row_nnz is not None else g.counts,
                d, g.slots, g.n_tiles, g.tile, row_limit, D=D, BE=BE, NTP=NTP, TRACK=unit_counts is not None,
                WHOLE_ROWS=dense_rows, ACC=add_to_out, num_warps=nw,
            )
            exact_launch()
        elif two_pass:
            # The exact path walks a whole tile; in the tuned narrow programs an overflowed
            # row of 5632 units takes 2816 steps, the tail of the launch. A second, wide
            # launch takes those tiles (its other programs stop after reading the counts).
            token_kernel(False, True, BE, nw)
            exact_launch()
        else:
            token_kernel(False, False, BE, nw)
    return out
