"""The FFN for small batches (decode, short prompts): only the batch's active units are read.

At ``M`` tokens per call the dense MLP reads all three ``[f, d]`` weight matrices whatever
``M`` is. Exactly, only the first projection (gate, or up for the non-gated MLP) must be read
whole: the up row and down column of a unit are needed only if the unit fires for some token
of the batch. Three steps:

1. ``pre = x w_first^T [M, f]`` by cuBLAS (a GEMV at this size, at HBM bandwidth; a Triton
   GEMV fused with step 2 measured 3 times slower on the H200).
2. ``_decode_up_kernel``, one program per (``BU`` units, ``BM`` tokens)::

       active[u] = any over the BM tokens of pre[m, u] > 0 (or NaN: relu keeps it)
       gated:      h[m, u] = relu(pre[m, u]) * (x[m] . w_up[u])   for active units only
       non-gated:  h[m, u] = relu(pre[m, u])

   The block's active units are compacted (a prefix sum over its ``BU`` units) and written with
   their ``h`` column: ``units [NC, NB, BU]``, ``h [NC, NB, BU, BM]``, ``counts [NC, NB]``. Up
   rows of inactive units are never loaded (masked loads issue no memory traffic).
3. ``_decode_down_kernel``, one program per (``BD`` columns of d, share of the entries, ``BM``
   tokens)::

       y[m, cols] = sum over the chunk's active units u of h[m, u] * w_down_t[u, cols]

   Entry ``e`` of the chunk's concatenated lists belongs to the first block whose inclusive
   prefix count exceeds it. Each program reads ``BD`` columns of the active units' down rows
   (``w_down_t [f, d]``: one unit's down column is one contiguous row). With one share it writes
   ``y`` directly; with several, fp32 partials that ``_decode_sum_kernel`` adds in a fixed order.
   No atomics on ``y``, no zeroing, deterministic.

Bytes at M = 1, d 2048, f 5632, 29 active units, bf16: 23 MB of gate rows plus 0.24 MB of up
and down rows, against 69 MB for the dense MLP. Exact for every input: a dense batch reads every
row, as dense does (but slower than cuBLAS: the dispatcher keeps such layers dense). No host
synchronisation and a fixed launch shape per ``M``: it can be captured in a CUDA graph.
"""

from __future__ import annotations

from typing import Optional

import torch
import triton
import triton.language as tl

from ..checks import KERNEL_DTYPES, check_config, check_launchable, check_tensor, check_weight_rows
from ._activity import fires
from ._dot import dot_operand, dot_precision
from ._launch import on_device_of

__all__ = ["ffn_decode", "decode_launch", "check_stat_buffers", "decode_config", "DECODE_CONFIGS"]


@triton.jit
def _rows_times_units(x_rows, rmask, w_ptr, stride_w, units, wmask, d,
                      BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr, PREC: tl.constexpr):
    """``[BM, BU]`` fp32: the block's token rows (``x_rows``: their row pointers, ``rmask``) times
    the rows ``units`` of ``w`` (``[f, d]``, unit-stride rows), d in steps of BK; units outside
    ``wmask`` are never read (their columns come out 0)."""
    ks = tl.arange(0, BK)
    acc = tl.zeros([BM, BU], dtype=tl.float32)
    for k0 in range(0, d, BK):
        kk = k0 + ks
        kmask = kk < d
        xa = tl.load(x_rows + kk[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        w = tl.load(w_ptr + units.to(tl.int64)[None, :] * stride_w + kk[:, None], mask=wmask[None, :] & kmask[:, None], other=0.0)
        acc = tl.dot(dot_operand(xa, PREC), dot_operand(w, PREC), acc, input_precision=PREC)
    return acc


@triton.jit
def _decode_up_kernel(
    pre_ptr, stride_pm,
    x_ptr, stride_xm,
    wu_ptr, stride_wu,
    h_ptr, unit_ptr, cnt_ptr,
    uc_ptr, nnz_ptr,
    M, d, f, NB,
    BM: tl.constexpr, BU: tl.constexpr, BK: tl.constexpr,
    GATED: tl.constexpr, TRACK: tl.constexpr, PREC: tl.constexpr,
):
    b = tl.program_id(0)
    c = tl.program_id(1)
    rows = c * BM + tl.arange(0, BM)
    rmask = rows < M
    units = b * BU + tl.arange(0, BU)
    umask = units < f
    a = tl.load(pre_ptr + rows.to(tl.int64)[:, None] * stride_pm + units[None, :], mask=rmask[:, None] & umask[None, :], other=0.0)
    a = a.to(tl.float32)
    on = fires(a)
    active = tl.max(on.to(tl.int32), axis=0) > 0  # [BU]: fires for some token of the chunk
    n_act = tl.sum(active.to(tl.int32), axis=0)
    blk = c * NB + b
    tl.store(cnt_ptr + blk, n_act)
    if TRACK:
        tl.atomic_add(uc_ptr + units, tl.sum(on.to(tl.int32), axis=0), mask=active)
        tl.atomic_add(nnz_ptr + rows, tl.sum(on.to(tl.int32), axis=1), mask=rmask)
    if n_act > 0:
        g = tl.where(on, a, 0.0)
        if GATED:
            x_rows = x_ptr + rows.to(tl.int64)[:, None] * stride_xm
            u = _rows_times_units(x_rows, rmask, wu_ptr, stride_wu, units, active, d, BM, BU, BK, PREC)
            # the dense path rounds the up projection to x's dtype before the product
            g = g * u.to(h_ptr.dtype.element_ty).to(tl.float32)
        slot = tl.cumsum(active.to(tl.int32), axis=0) - 1
        entry = blk.to(tl.int64) * BU + slot
        tl.store(unit_ptr + entry, units, mask=active)
        ms = tl.arange(0, BM)
        tl.store(h_ptr + entry[:, None] * BM + ms[None, :], tl.trans(g).to(h_ptr.dtype.element_ty), mask=active[:, None])


@triton.jit
def _decode_down_kernel(
    h_ptr, unit_ptr, cnt_ptr,
    wd_ptr, stride_wd,
    y_ptr, stride_ym, part_ptr,
    M, d, NB,
    BM: tl.constexpr, BU: tl.constexpr, BD: tl.constexpr, BE: tl.constexpr, NBP: tl.constexpr,
    SPLITS: tl.constexpr, PREC: tl.constexpr,
):
    # program (j, s, c): columns [j BD, (j + 1) BD) of tokens chunk c, over the s-th share of the
    # chunk's entries. With one share it writes y; with several, an fp32 partial that
    # _decode_sum_kernel adds up in a fixed order (deterministic, no atomics).
    j = tl.program_id(0)
    sp = tl.program_id(1)
    c = tl.program_id(2)
    blocks = tl.arange(0, NBP)
    cnt = tl.load(cnt_ptr + c * NB + blocks, mask=blocks < NB, other=0)
    incl = tl.cumsum(cnt, axis=0)
    excl = incl - cnt
    n = tl.sum(cnt, axis=0)
    per = tl.cdiv(tl.cdiv(n, SPLITS), BE) * BE
    lo = sp * per
    hi = tl.minimum(n, lo + per)
    cols = j * BD + tl.arange(0, BD)
    cmask = cols < d
    ms = tl.arange(0, BM)
    acc = tl.zeros([BM, BD], dtype=tl.float32)
    for e0 in range(lo, hi, BE):
        e = e0 + tl.arange(0, BE)
        valid = e < hi
        blk = tl.sum((incl[None, :] <= e[:, None]).to(tl.int32), axis=1)  # [BE]
        first = tl.sum(tl.where(blocks[None, :] == blk[:, None], excl[None, :], 0), axis=1)
        entry = (c * NB + blk).to(tl.int64) * BU + (e - first)
        unit = tl.load(unit_ptr + entry, mask=valid, other=0).to(tl.int64)
        h = tl.load(h_ptr + entry[:, None] * BM + ms[None, :], mask=valid[:, None], other=0.0)  # [BE, BM]
        w = tl.load(wd_ptr + unit[:, None] * stride_wd + cols[None, :], mask=valid[:, None] & cmask[None, :], other=0.0)
        acc = tl.dot(dot_operand(tl.trans(h), PREC), dot_operand(w, PREC), acc, input_precision=PREC)
    rows = c * BM + ms
    omask = (rows < M)[:, None] & cmask[None, :]
    if SPLITS == 1:
        tl.store(y_ptr + rows.to(tl.int64)[:, None] * stride_ym + cols[None, :], acc.to(y_ptr.dtype.element_ty), mask=omask)
    else:
        tl.store(part_ptr + (sp.to(tl.int64) * M + rows)[:, None] * d + cols[None, :], acc, mask=omask)


@triton.jit
def _decode_sum_kernel(part_ptr, y_ptr, stride_ym, M, d, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    # y = sum over the shares of the fp32 partials [SPLITS, M, d], in share order
    # M d in int64: from M d >= 2^31 / 7 (M 149797 at d 2048, through kernel_mode="decode")
    # the shares' offsets in int32 wrapped (a helper's audit, 2026-12-04)
    n = tl.cast(M, tl.int64) * d
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for sp in range(SPLITS):
        acc += tl.load(part_ptr + sp * n + offs, mask=mask, other=0.0)
    tl.store(y_ptr + (offs // d) * stride_ym + offs % d, acc.to(y_ptr.dtype.element_ty), mask=mask)


# What ffn_decode's config may hold (twell.checks.check_config): tensor-core tiles of at least 16.
DECODE_KNOBS = (("BM", 16, 256, True), ("BU", 16, 256, True), ("BK", 16, 4096, True), ("up warps", 1, 32, True),
                ("BD", 16, 8192, True), ("BE", 16, 1024, True), ("down warps", 1, 32, True), ("shares", 1, 64, False))

# (BM tokens, BU units, BK, warps of the up kernel, BD columns of d, BE entries, warps of the
# down kernel, shares of the entries) by tokens per call: the entry with the smallest key at or
# above M (the largest for bigger M). From a sweep on the H200. BM is at
# least 16, the smallest tensor-core tile; calls of more than BM tokens run in chunks of BM.
DECODE_CONFIGS: dict[int, tuple[int, int, int, int, int, int, int, int]] = {
    4: (16, 32, 256, 4, 16, 32, 4, 1),
    16: (16, 32, 256, 4, 64, 64, 4, 8),
    64: (64, 32, 256, 4, 64, 64, 4, 8),
}


def decode_config(M: int) -> tuple[int, int, int, int, int, int, int, int]:
    """Block shapes used for a call of ``M`` tokens."""
    for m in sorted(DECODE_CONFIGS):
        if M <= m:
            return DECODE_CONFIGS[m]
    return DECODE_CONFIGS[max(DECODE_CONFIGS)]


def check_decode_args(x, w_first, w_down_t, w_up) -> tuple[int, int, int]:
    """Clear errors for the small-batch kernels' inputs (see :func:`ffn_decode`); ``(M, d, f)``."""
    check_tensor(x, "x", dim=2, dtypes=KERNEL_DTYPES)
    M, d = x.shape
    check_tensor(w_first, "w_first", dim=2, dtypes=KERNEL_DTYPES)
    f = w_first.shape[0]
    check_weight_rows(w_first, "w_first", f, d, x)
    check_weight_rows(w_down_t, "w_down_t", f, d, x)
    check_weight_rows(w_up, "w_up", f, d, x)
    if x.stride(1) != 1:
        raise ValueError(f"x must have unit-stride rows, got strides {x.stride()}")
    check_launchable(x, "x")
    return M, d, f


def check_stat_buffers(x: torch.Tensor, unit_counts: Optional[torch.Tensor], row_nnz: Optional[torch.Tensor], f: int) -> None:
    """Clear errors for the optional statistics of a decode call of ``x [M, d]``: ``unit_counts``
    ``[f]`` and ``row_nnz`` ``[M]``, contiguous int32 on x's device, both or neither."""
    if (unit_counts is None) != (row_nnz is None):
        raise ValueError("pass unit_counts and row_nnz together (both or neither)")
    if unit_counts is not None:
        for t, name, n in ((unit_counts, "unit_counts", f), (row_nnz, "row_nnz", x.shape[0])):
            check_tensor(t, name, dim=1, dtypes=(torch.int32,))
            if t.shape[0] != n or not t.is_contiguous() or t.device != x.device:
                raise ValueError(f"{name} must be a contiguous [{n}] int32 tensor on {x.device}, got "
                                 f"{list(t.shape)} {t.dtype} on {t.device}")


def ffn_decode(
    x: torch.Tensor,
    w_first: torch.Tensor,
    w_down_t: torch.Tensor,
    *,
    w_up: Optional[torch.Tensor] = None,
    out: Optional[torch.Tensor] = None,
    unit_counts: Optional[torch.Tensor] = None,
    row_nnz: Optional[torch.Tensor] = None,
    config: Optional[tuple[int, int, int, int, int, int, int, int]] = None,
) -> torch.Tensor:
    """The whole FFN of a small batch, reading only the up and down rows of the batch's active units.

    Args:
        x: ``[M, d]`` tokens (fp16, bf16, or fp32; unit-stride rows). Any ``M``; the kernels
            pay off where the MLP is bound by weight reads (a few hundred tokens at most).
        w_first: ``[f, d]`` the first projection: ``w_gate`` (gated) or ``w_up`` (non-gated).
        w_down_t: ``[f, d]``: row ``j`` is ``w_down[:, j]`` (for a ``w_down [d, f]`` stored
            transposed, ``w_down.t()``).
        w_up: ``[f, d]`` up rows for the gated MLP ``relu(x w_gate^T) * (x w_up^T)``; None:
            non-gated, ``h = relu(x w_first^T)``.
        out: optional ``[M, d]`` output (x's dtype, unit-stride rows).
        unit_counts: optional ``[f]`` int32, incremented by the number of tokens each unit
            fired for; row_nnz: optional ``[M]`` int32, *incremented* by each token's active
            units (pass zeros). Both or neither.
        config: block shapes (see :data:`DECODE_CONFIGS`).

    Returns:
        ``y [M, d]``: ``(relu(x w_first^T) [* (x w_up^T)]) w_down_t`` with fp32 accumulation.
    """
    M, d, f = check_decode_args(x, w_first, w_down_t, w_up)
    check_stat_buffers(x, unit_counts, row_nnz, f)
    if out is not None and (
        tuple(out.shape) != (M, d) or out.dtype != x.dtype or out.stride(1) != 1 or out.device != x.device or (M > 1 and out.stride(0) < d)
    ):
        raise ValueError(f"out must be [{M}, {d}] {x.dtype} on {x.device} with unit-stride, non-overlapping rows")
    if config is not None:
        check_config(config, DECODE_KNOBS)
    return decode_launch(x, w_first, w_down_t, w_up, unit_counts, row_nnz, out=out, config=config)


def decode_launch(x, w_first, w_down_t, w_up=None, unit_counts=None, row_nnz=None, *, out=None, config=None,
                  with_counts: bool = False):
    """:func:`ffn_decode` without the argument checks, for callers that validated them (the
    modules, once per call): a decode call is a few microseconds of GPU work, so host time counts.

    Returns ``y``, or with ``with_counts`` ``(y, counts, BM)``: ``counts [NC * NB]`` int32, the
    active units of each (chunk of ``BM`` tokens, block of units)."""
    M, d = x.shape
    f = w_first.shape[0]
    if M == 0 or d == 0 or f == 0:
        out = torch.empty(M, d, dtype=x.dtype, device=x.device) if out is None else out
        out.zero_()
        return (out, torch.zeros(0, dtype=torch.int32, device=x.device), 16) if with_counts else out
    BM, BU, BK, nw1, BD, BE, nw2, S = config or decode_config(M)
    NB, NC = triton.cdiv(f, BU), triton.cdiv(M, BM)
    pre = torch.mm(x, w_first.t())  # cuBLAS: the whole first projection, at HBM bandwidth
    # scratch: per (token chunk, unit block) the active units and their h columns
    h = torch.empty(NC * NB * BU * BM, dtype=x.dtype, device=x.device)
    units = torch.empty(NC * NB * BU, dtype=torch.int32, device=x.device)
    counts = torch.empty(NC * NB, dtype=torch.int32, device=x.device)
    if out is None:
        out = torch.empty(M, d, dtype=x.dtype, device=x.device)
    part = torch.empty(S * M * d, dtype=torch.float32, device=x.device) if S > 1 else counts
    prec = dot_precision(x)
    track = unit_counts is not None
    w_up_ = w_up if w_up is not None else w_first
    with on_device_of(x):
        _decode_up_kernel[(NB, NC)](
            pre, pre.stride(0), x, x.stride(0), w_up_, w_up_.stride(0),
            h, units, counts, unit_counts if track else counts, row_nnz if track else counts,
            M, d, f, NB,
            BM=BM, BU=BU, BK=min(BK, max(16, triton.next_power_of_2(d))), GATED=w_up is not None, TRACK=track, PREC=prec,
            num_warps=nw1,
        )
        _decode_down_kernel[(triton.cdiv(d, BD), S, NC)](
            h, units, counts, w_down_t, w_down_t.stride(0), out, out.stride(0), part,
            M, d, NB,
            BM=BM, BU=BU, BD=BD, BE=BE, NBP=max(16, triton.next_power_of_2(NB)), SPLITS=S, PREC=prec,
            num_warps=nw2,
        )
        if S > 1:
            _decode_sum_kernel[(triton.cdiv(M * d, 1024),)](part, out, out.stride(0), M, d, SPLITS=S, BLOCK=1024, num_warps=4)
    return (out, counts, BM) if with_counts else out

