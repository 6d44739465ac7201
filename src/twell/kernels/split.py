"""The FFN from a one-tile TwELL in two passes: up (per token), then down (per slice of d).

The fused token kernel (:mod:`twell.kernels.updown`) gathers, for every (token, active unit)
pair, the unit's up row and down column from L2: 8 KB per pair at d = 2048, which bounds it at
about 8 TB/s of gathers on the H200. This file splits the work so that the down half reuses its
weights across tokens:

``up_from_twell`` (pass 1, one program per ``BT`` tokens)
    ``h[m, e] = g[m, e] * (x[m] . w_up[col[m, e]])``: the TwELL of ``h``, same columns as ``g``,
    values rounded to x's dtype as the dense MLP rounds ``g * u`` before its down matmul.

``down_from_twell`` (pass 2, one program per (slice of ``DS`` columns of d, ``BT`` tokens))
    ``y[m, s] = sum_e h[m, e] * w_down_t[col[m, e], s]``. Programs are numbered slice-major, so
    the programs resident on the GPU at any moment work on one or two slices, and the slice of
    ``w_down_t`` they gather from (``f * DS`` elements: 180 KB at f = 5632, DS = 16, bf16) stays
    in each SM's L1 cache: the gathers of this pass are served from L1 instead of L2.

Overflowed rows (``counts > slots``: their entries were not stored) get ``h = 0`` entries and
``y = 0`` from these passes; the caller then runs the exact path of the token kernel on them
(``ONLY_OVER``), which recomputes those rows from the dense pre-activation.
"""

from __future__ import annotations

import triton
import triton.language as tl

__all__ = ["up_kernel", "down_kernel"]


@triton.jit
def up_kernel(
    x_ptr, stride_xm,
    cnt_ptr, val_ptr, col_ptr, h_ptr,
    wu_ptr, stride_wu,
    M, d, SLOTS,
    D: tl.constexpr, BE: tl.constexpr,
):
    # One token per program: x[m] in registers (fp32), entries BE at a time, each a gathered
    # [BE, D] block of up rows reduced against x.
    m = tl.program_id(0).to(tl.int64)
    cnt = tl.load(cnt_ptr + m)
    n = tl.where(cnt > SLOTS, 0, cnt)
    offs_d = tl.arange(0, D)
    dmask = offs_d < d
    x = tl.load(x_ptr + m * stride_xm + offs_d, mask=dmask & ((offs_d * 0 + n) > 0), other=0.0).to(tl.float32)
    row = m * SLOTS
    for e0 in range(0, n, BE):
        e = e0 + tl.arange(0, BE)
        valid = e < n
        unit = tl.load(col_ptr + row + e, mask=valid, other=0).to(tl.int64)
        g = tl.load(val_ptr + row + e, mask=valid, other=0.0).to(tl.float32)
        wu = tl.load(wu_ptr + unit[:, None] * stride_wu + offs_d[None, :], mask=valid[:, None] & dmask[None, :], other=0.0)
        h = g * tl.sum(wu.to(tl.float32) * x[None, :], axis=1)
        tl.store(h_ptr + row + e, h.to(h_ptr.dtype.element_ty), mask=valid)


@triton.jit
def down_kernel(
    cnt_ptr, h_ptr, col_ptr,
    wd_ptr, stride_wd,
    y_ptr, stride_ym,
    uc_ptr, nnz_ptr,
    M, d, SLOTS, N_TB,
    BT: tl.constexpr, BE: tl.constexpr, DS: tl.constexpr, TRACK: tl.constexpr,
):
    # Slice-major numbering: programs s * N_TB .. s * N_TB + N_TB - 1 all read slice s of
    # w_down_t, so the resident ones share it through L1.
    pid = tl.program_id(0)
    s = pid // N_TB
    tb = pid % N_TB
    rows = (tb * BT + tl.arange(0, BT)).to(tl.int64)
    rmask = rows < M
    cnt = tl.load(cnt_ptr + rows, mask=rmask, other=0)
    n = tl.where(cnt > SLOTS, 0, cnt)
    n_max = tl.max(n, axis=0)
    ds = s * DS + tl.arange(0, DS)
    dmask = ds < d
    acc = tl.zeros([BT, DS], dtype=tl.float32)
    for e0 in range(0, n_max, BE):
        e = e0 + tl.arange(0, BE)
        valid = e[None, :] < n[:, None]  # [BT, BE]
        off = rows[:, None] * SLOTS + e[None, :]
        unit = tl.load(col_ptr + off, mask=valid, other=0).to(tl.int64)
        h = tl.load(h_ptr + off, mask=valid, other=0.0).to(tl.float32)
        w = tl.load(
            wd_ptr + unit[:, :, None] * stride_wd + ds[None, None, :],
            mask=valid[:, :, None] & dmask[None, None, :], other=0.0,
        )
        acc += tl.sum(h[:, :, None] * w.to(tl.float32), axis=1)
        if TRACK:
            tl.atomic_add(uc_ptr + unit, tl.full([BT, BE], 1, dtype=tl.int32), mask=valid & (s == 0))
    tl.store(y_ptr + rows[:, None] * stride_ym + ds[None, :], acc.to(y_ptr.dtype.element_ty), mask=rmask[:, None] & dmask[None, :])
    if TRACK:
        tl.store(nnz_ptr + rows, cnt, mask=rmask & (s == 0))
